"""textgate.shard_server.startup: sizing and measurement before the first request.

How large the KV cache may be (`cache_config`, `memory` on a GPU), the shapes-only warmup
pass and whether decode graphs are recorded (`paged_warmup`), the shard's own step timed
for the router (`step_timing`), `--dtype auto`'s trial of each dtype (`dtype_choice`),
and what the CPU kernels run on here (`hardware`). Run once at load and warmup; built on
`step/`, below the protocols that call it.
"""
