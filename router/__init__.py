"""The router process: HTTP in front, the step engine behind, gRPC to the shards.

- `http/`: the Starlette app and what every route shares (validation, SSE, errors, docs).
- `tgi/`: TGI's routes and JSON shapes; `openai/`: the OpenAI-compatible routes.
- `engine/`: admission, the step loop, the scheduler and KV blocks.
- `shard_client.py`: gRPC to the shards; `server.py`: the process's start-up and serving.
"""
