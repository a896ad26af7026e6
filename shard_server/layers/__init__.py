"""textgate.shard_server.layers: the building blocks of native models (norms, rotary,
tensor-parallel linears and embeddings)."""
