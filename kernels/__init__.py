"""textgate.kernels"""
