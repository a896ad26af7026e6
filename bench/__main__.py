"""`python -m textgate.bench`: the same as the `textgate-bench` console script."""

from __future__ import annotations

from textgate.bench.serving.cli import main

raise SystemExit(main())
