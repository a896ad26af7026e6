"""textgate.bench.soak: the reliability soak (`python -m textgate.bench.soak`, `make soak`).

`run` drives many mixed requests against a real launcher and judges the run (nothing
lost, nothing leaks, no p99 drift); `traffic` draws the requests and judges each answer;
`server` starts the soaked server and reads its memory and /metrics.
"""
