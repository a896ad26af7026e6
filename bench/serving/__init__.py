"""textgate.bench.serving: the serving benchmark every textgate performance claim uses.

`cli` (textgate-bench) drives a TGI or OpenAI streaming server through `runner` (levels,
rounds, A/B turns), `load` (closed/open loop), `request` (one timed stream, parsed by
`sse` + `backends`) and `workload` (prompts); `metrics` computes vLLM-defined metrics and
`report`/`plot` present them. `naive` is the transformers baseline, `roofline` the
matmul-only ceiling, `sweep` (make bench) runs all three against a local textgate;
`peers` runs textgate and a peer server side by side.
"""
