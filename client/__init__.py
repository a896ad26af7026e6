"""textgate.client"""
