"""The step engine: admission, the loops that step the shards, the scheduler and KV blocks.

No torch and no HTTP: requests arrive as `ValidRequest`s, leave as channel events."""
