"""textgate.shard_server.protocols: the step protocol of generate.proto.

`paged_model.PagedModel` serves a model (`models/`: a native class, or transformers'
modules) over the paged KV cache, one router-planned `Step` at a time; the servicer
(`server.py`) calls it.
"""
