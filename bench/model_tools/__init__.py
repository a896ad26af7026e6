"""textgate.bench.model_tools: tools about a model rather than the server.

`perplexity`: a model's perplexity and resident weight bytes through textgate's own shard
model; `twin`: a model folder shaped like another, with random weights.
"""
