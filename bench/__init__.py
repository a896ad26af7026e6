"""textgate.bench: benchmarks, by role; they print numbers and are not timed tests.

`serving/`: the load generator (textgate-bench, `python -m textgate.bench`) and the sweep
every performance claim uses; `micro/`: kernel and step micro-benchmarks; `soak/`: the
reliability soak; `model_tools/`: perplexity and random-weight twins of a model.
`gpu_check.sh` runs the GPU check (docs/gpu.md).
"""
