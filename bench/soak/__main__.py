"""`python -m textgate.bench.soak`: the soak (`run.main`)."""

from __future__ import annotations

from textgate.bench.soak.run import main

raise SystemExit(main())
