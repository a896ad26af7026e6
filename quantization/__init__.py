"""textgate.quantization"""
