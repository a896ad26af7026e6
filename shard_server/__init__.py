"""textgate.shard_server"""
