"""textgate.shard_server.protocols: the interface the servicer talks to and its two step protocols.

`shard_model.ShardModel` is the interface (and its errors); `paged_model.PagedModel`
serves a native model (`models/`) over the paged KV cache, one router-planned `Step` at a
time; `padded_model.PaddedModel` serves TGI's Prefill / Decode / FilterBatch over batches
cached by id, the protocol of the transformers fallback (`transformers_model`,
`causal_lm`).
"""
