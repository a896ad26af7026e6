"""textgate.bench.micro: micro-benchmarks, one kernel or one step at a time, no HTTP.

The CPU linear candidates (`int4_linear`, `int8_linear`, `bnb_linear`, timed round-robin
by `timing`), paged attention per backend (`attention`), the shard's own step
(`step`), and the native model's step on a GPU against the HBM roofline (`gpu_kernels`,
over `gpu_model` and `gpu_runs`). They print tables (`serving.report`); they are how the
kernels' fast paths were chosen.
"""
