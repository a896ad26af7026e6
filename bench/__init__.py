"""textgate.bench"""
