"""lm-evaluation-harness runs for test_lm_eval.py; runs with the harness venv's python only.

Reads a JSON list of runs from argv[1] (each `{"name", "model", "model_args", "tasks",
"apply_chat_template"}`), evaluates them one after the other in this one process (the
harness's imports take longer than these tiny tasks), and writes
`{name: {task: [each doc's filtered_resps, in doc order]}}` as JSON to argv[2]. Run it
from lm_eval_tasks/: the tasks' data files are relative to it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lm_eval
from lm_eval.tasks import TaskManager

TASKS = Path(__file__).resolve().with_name("lm_eval_tasks")


def evaluate(run: dict[str, Any], tasks: TaskManager) -> dict[str, list[Any]]:
    """Each task's per-document responses (the harness's `filtered_resps`)."""
    results = lm_eval.simple_evaluate(
        model=run["model"],
        model_args=run["model_args"],
        tasks=run["tasks"],
        device="cpu",
        apply_chat_template=run.get("apply_chat_template", False),
        task_manager=tasks,
        log_samples=True,
    )
    assert results is not None
    samples = results["samples"]
    return {
        task: [s["filtered_resps"] for s in sorted(samples[task], key=lambda s: s["doc_id"])]
        for task in run["tasks"]
    }


def main() -> None:
    runs = json.loads(sys.argv[1])
    tasks = TaskManager(include_path=str(TASKS))
    report = {run["name"]: evaluate(run, tasks) for run in runs}
    Path(sys.argv[2]).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
