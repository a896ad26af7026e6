"""textgate.router"""
