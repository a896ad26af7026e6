"""bench/gpu_check.sh in its CPU dry run: the files a GPU run leaves in $OUT, and step failures.

The sweep step (a served twin of the default model, ~1 min on CPU) is left out here:
`make gpu-check-dry` runs every step.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import textgate

SCRIPT = Path(textgate.__file__).resolve().parent / "bench" / "gpu_check.sh"


def test_dry_run_writes_the_gpu_runs_files_and_reports_a_failed_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(
        os.environ,
        GPU_CHECK_DRY_RUN="1",
        OUT=str(out),
        PYTHON=sys.executable,
        # A step that does not exist fails; the ones after it still run.
        GPU_CHECK_STEPS="meta bogus pytest kernels",
    )
    done = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_kernels.json",
        "gpu_kernels.md",
        "meta.json",
        "pytest_gpu.log",
        "summary.md",
    ]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dry_run"] is True and meta["gpu"] is None
    assert re.fullmatch(r"[0-9a-f]{40}", meta["commit"])
    assert meta["date"].startswith("20") and meta["torch"]
    kernels = json.loads((out / "gpu_kernels.json").read_text())
    assert kernels["shape"]["name"] == "tiny" and kernels["rows"]
    summary = (out / "summary.md").read_text()
    assert re.search(r"meta: ok \(\d+ s\); bogus: FAILED \(\d+ s\); pytest: ok", summary)
    assert "kernels: ok" in summary
    assert (out / "gpu_kernels.md").read_text() in summary
