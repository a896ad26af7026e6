"""lm-evaluation-harness 0.4.13 (in its own venv) against a live textgate, equal to its `hf`.

The harness scores this folder's small tasks (lm_eval_tasks/: multiple choice, a rolling
loglikelihood, short greedy answers) through textgate's `/v1/completions` and
`/v1/chat/completions`, and with its own `hf` backend on the same model folder in
float32: every choice's loglikelihood and every page's rolling one agree within 2e-3,
and the generated answers are the same text.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from textgate.tests.compat import lm_eval_harness as harness

# The harness's runs are set up by the first test (~3-5 min on 2 busy cores).
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

TOLERANCE = 2e-3
TASKS = ["textgate_mc", "textgate_ppl", "textgate_gen"]


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    """The harness venv's bin/: fails when it cannot be built, skips only without PyPI."""
    try:
        return harness.ensure_venv()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
        try:
            httpx.head(harness.PYPI_SIMPLE, timeout=10, follow_redirects=True)
        except httpx.HTTPError:
            pytest.skip(f"PyPI is unreachable, so lm-eval cannot be installed: {err}")
        pytest.fail(f"cannot build lm-eval's venv ({harness.venv_dir()}): {err}")


@pytest.fixture(scope="module")
def served(
    bin_dir: Path,
    live_server: str,
    default_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, list[Any]]:
    """Each task's responses from `lm_eval run --model local-completions` (docs/api.md's)."""
    output = tmp_path_factory.mktemp("lm-eval-served")
    harness.run(harness.completions_command(bin_dir, live_server, default_model_dir, TASKS, output))
    return {task: harness.logged_samples(output, task) for task in TASKS}


@pytest.fixture(scope="module")
def reference(
    bin_dir: Path,
    live_server: str,
    default_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """The `hf` backend's responses (plain, and chat-templated) and `local-chat-completions`'."""
    hf_args = f"pretrained={default_model_dir},dtype=float32"
    chat_args = f"model=tgi,base_url={live_server}/v1/chat/completions,num_concurrent=2"
    runs = [
        {"name": "hf", "model": "hf", "model_args": hf_args, "tasks": TASKS},
        {"name": "hf_chat", "model": "hf", "model_args": hf_args, "tasks": ["textgate_gen"]},
        {"name": "chat", "model": "local-chat-completions", "model_args": chat_args},
    ]
    runs[1]["apply_chat_template"] = runs[2]["apply_chat_template"] = True
    runs[2]["tasks"] = ["textgate_gen"]
    report = tmp_path_factory.mktemp("lm-eval-reference") / "report.json"
    return harness.run_check(bin_dir, runs, report)


def loglikelihoods(responses: list[Any]) -> list[tuple[float, bool]]:
    """(loglikelihood, is_greedy) of every choice of every document, in order."""
    return [(float(ll), str(greedy) == "True") for doc in responses for ll, greedy in doc]


def firsts(responses: list[Any]) -> list[Any]:
    """The one response of each document (rolling loglikelihood, generated text)."""
    return [doc[0] for doc in responses]


def test_every_choice_scores_as_in_hf(served: dict[str, Any], reference: dict[str, Any]) -> None:
    ours = loglikelihoods(served["textgate_mc"])
    theirs = loglikelihoods(reference["hf"]["textgate_mc"])
    assert len(ours) == len(theirs) == 14
    for (mine, my_greedy), (hf, hf_greedy) in zip(ours, theirs, strict=True):
        assert mine == pytest.approx(hf, abs=TOLERANCE)
        assert my_greedy == hf_greedy


def test_rolling_loglikelihood_is_hfs(served: dict[str, Any], reference: dict[str, Any]) -> None:
    ours = [float(ll) for ll in firsts(served["textgate_ppl"])]
    theirs = [float(ll) for ll in firsts(reference["hf"]["textgate_ppl"])]
    assert ours == pytest.approx(theirs, abs=TOLERANCE)


def test_generated_answers_are_hfs(served: dict[str, Any], reference: dict[str, Any]) -> None:
    answers = firsts(served["textgate_gen"])
    assert answers == firsts(reference["hf"]["textgate_gen"])
    assert any(answer.strip() for answer in answers)


def test_chat_answers_are_hfs_with_the_chat_template(reference: dict[str, Any]) -> None:
    answers = firsts(reference["chat"]["textgate_gen"])
    assert answers == firsts(reference["hf_chat"]["textgate_gen"])
    assert any(answer.strip() for answer in answers)
