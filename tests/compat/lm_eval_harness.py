"""lm-evaluation-harness in its own venv, and the runs test_lm_eval.py compares.

lm-eval pins its own dependencies (datasets, evaluate, ...), so it lives in a venv of its
own, built once into textgate's cache (`tests/fixtures/cached_venv.py`) with the pinned
CPU torch installed first and the transformers textgate runs, so that its `hf` backend
and textgate read the same model code and tokenizer.

`completions_command` is the command line docs/api.md shows ("Evaluation harnesses");
the other runs go through `lm_eval_check.py`, one process for all of them.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from textgate.tests.fixtures import cached_venv

LM_EVAL_SPECS = ("lm-eval[api,hf]==0.4.13", "transformers==5.24.0")
HERE = Path(__file__).resolve().parent
TASKS_DIR = HERE / "lm_eval_tasks"
CHECK_SCRIPT = HERE / "lm_eval_check.py"
PYPI_SIMPLE = "https://pypi.org/simple/lm-eval/"
# Local files only: no hub look-ups for the model folder or the tokenizer.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def venv_dir() -> Path:
    """The harness's venv: one per (torch spec, lm-eval specs, Python, machine)."""
    return cached_venv.venv_dir("lm-eval", cached_venv.makefile_spec("TORCH_SPEC"), *LM_EVAL_SPECS)


def ensure_venv() -> Path:
    """The harness's venv, built first if missing (~3 min; PyPI); its `bin/` folder."""
    torch = [cached_venv.makefile_spec("TORCH_SPEC")]
    return cached_venv.ensure_venv(venv_dir(), [torch, list(LM_EVAL_SPECS)]) / "bin"


def completions_args(base_url: str, model_dir: Path) -> str:
    """`--model_args` of `local-completions` against textgate: prompts sent as text, with
    the model's own tokenizer (the harness counts the context's tokens with it)."""
    return (
        f"model=tgi,base_url={base_url}/v1/completions,tokenizer={model_dir},"
        "tokenizer_backend=huggingface,tokenized_requests=False,num_concurrent=2"
    )


def completions_command(
    bin_dir: Path, base_url: str, model_dir: Path, tasks: Sequence[str], output: Path
) -> list[str]:
    """`lm_eval run --model local-completions` over `tasks`, samples logged under `output`."""
    return [
        str(bin_dir / "lm_eval"),
        "run",
        "--model",
        "local-completions",
        "--model_args",
        completions_args(base_url, model_dir),
        "--tasks",
        ",".join(tasks),
        "--include_path",
        ".",
        "--output_path",
        str(output),
        "--log_samples",
    ]


def logged_samples(output: Path, task: str) -> list[Any]:
    """Each document's `filtered_resps` from the samples file the CLI wrote for `task`."""
    (path,) = output.glob(f"*/samples_{task}_*.jsonl")
    samples = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [s["filtered_resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]


def run_check(bin_dir: Path, runs: list[dict[str, Any]], report: Path) -> dict[str, Any]:
    """`lm_eval_check.py` over `runs`; its report (run name -> task -> responses)."""
    run([str(bin_dir / "python"), str(CHECK_SCRIPT), json.dumps(runs), str(report)])
    result: dict[str, Any] = json.loads(report.read_text())
    return result


def run(command: list[str], *, timeout_s: float = 900.0) -> None:
    """Run a harness command from the tasks' folder; RuntimeError with its log if it fails."""
    proc = subprocess.run(
        command,
        cwd=TASKS_DIR,
        env={**os.environ, **OFFLINE},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{Path(command[0]).name} exited {proc.returncode}:\n{proc.stderr[-6000:]}"
        )
