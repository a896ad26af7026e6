"""textgate.shard_server.loading: from a model id to the `PagedModel` a shard serves.

Where the weights come from (`model_source`: a local folder, a hub id, the embedded
default), and which implementation serves them on this rank (`shard_loader`: device,
process group, tokenizer, a native class or transformers' modules, on the paged engine).
"""
