"""`--dtype auto` on CPU: the rule (lowest score wins), and the candidates built and timed
through the loader, or the quantization method's dtype taken without a trial."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.loading import shard_loader
from textgate.shard_server.protocols.paged_model import PagedModel
from textgate.shard_server.startup import dtype_choice
from textgate.shard_server.startup.dtype_choice import DtypeTrial
from textgate.shard_server.startup.step_timing import ProbePlan, StepTimings, dtype_name
from textgate.tests.shard_server.startup.test_step_timing import load, timings

# -- the rule --------------------------------------------------------------------------------


def test_the_score_is_the_sum_of_the_timed_steps() -> None:
    assert dtype_choice.dtype_score(timings({1: 30.0, 32: 200.0}, 70.0)) == 300.0


def test_the_lowest_score_wins_whichever_step_it_wins_on() -> None:
    # bf16 faster at batch 1 (35 vs 46 ms), slower at batch 32: the sum decides.
    fp32 = DtypeTrial(torch.float32, timings({1: 46.0, 32: 140.0}, 60.0))
    bf16 = DtypeTrial(torch.bfloat16, timings({1: 35.0, 32: 160.0}, 65.0))
    choice = dtype_choice.choose_dtype([fp32, bf16])
    assert choice.dtype == torch.float32 and choice.source == "measured"
    assert choice.trials == (fp32, bf16)
    faster = DtypeTrial(torch.bfloat16, timings({1: 35.0, 32: 130.0}, 65.0))
    choice = dtype_choice.choose_dtype([fp32, faster])
    assert choice.dtype == torch.bfloat16 and choice.trials == (faster, fp32)


def test_a_tie_keeps_the_first_candidate() -> None:
    same = timings({1: 10.0}, 10.0)
    trials = [DtypeTrial(torch.float32, same), DtypeTrial(torch.bfloat16, same)]
    assert dtype_choice.choose_dtype(trials).dtype == torch.float32


def test_trials_of_different_steps_do_not_compare() -> None:
    with pytest.raises(ValueError, match="different steps"):
        dtype_choice.choose_dtype(
            [
                DtypeTrial(torch.float32, timings({1: 10.0, 32: 50.0}, 10.0)),
                DtypeTrial(torch.bfloat16, timings({1: 10.0}, 10.0)),
            ]
        )
    with pytest.raises(ValueError, match="no dtype trials"):
        dtype_choice.choose_dtype([])


# -- through the loader ----------------------------------------------------------------------


def test_auto_on_cpu_keeps_the_measured_winner_and_frees_the_loser(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The trials' timings are fixed here (bf16 wins); building the candidates is real.
    def fixed(model: PagedModel, plan: ProbePlan) -> StepTimings:
        step = 10.0 if model.model.dtype == torch.bfloat16 else 20.0
        return timings(dict.fromkeys(plan.batch_sizes, step), step, plan.prefill_tokens)

    monkeypatch.setattr(dtype_choice, "trial_timings", fixed)
    built: list[weakref.ref[PagedModel]] = []

    def build(dtype: torch.dtype) -> PagedModel:
        model = load(tiny_model_dir, "float32" if dtype == torch.float32 else "bfloat16")
        built.append(weakref.ref(model))
        return model

    chosen = dtype_choice.pick_dtype(build)
    gc.collect()
    assert chosen.model.dtype == torch.bfloat16
    assert [ref() is None for ref in built] == [True, False]  # float32's model is freed
    choice = chosen.dtype_choice
    assert choice.source == "measured"
    assert [t.dtype for t in choice.trials] == [torch.bfloat16, torch.float32]
    assert chosen.kv_cache is None  # the trial's cache is gone; Warmup allocates the real one
    warm = chosen.warmup(pb.WarmupRequest(max_prefill_tokens=16))
    assert warm.dtype_source == "measured" and warm.dtype == "bfloat16"
    assert [t.dtype for t in warm.dtype_trials] == ["bfloat16", "float32"]
    assert warm.dtype_trials[1].score_ms == pytest.approx(20.0 * 3)
    decode = {t.batch_size: t.step_ms for t in warm.decode_timings}
    assert list(decode) == [1, 8, 32]
    assert decode[1] == decode[32] == 10.0  # the trial's steps, not timed twice


@pytest.mark.parametrize("disturbed", ["bfloat16", "float32", None])
def test_a_disturbed_trial_has_both_models_timed_again_before_one_goes(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, disturbed: str | None
) -> None:
    # bf16 is the faster (10 ms a step to fp32's 20), but the disturbed dtype's first trial
    # saw a busy machine and took 50 ms a step: timed again, it shows its real speed.
    runs: list[tuple[str, int]] = []

    def fixed(model: PagedModel, plan: ProbePlan) -> StepTimings:
        name = "bfloat16" if model.model.dtype == torch.bfloat16 else "float32"
        runs.append((name, len(runs)))
        first = sum(1 for n, _ in runs if n == name) == 1
        busy = first and name == disturbed
        step = 50.0 if busy else 10.0 if name == "bfloat16" else 20.0
        decode = dict.fromkeys(plan.batch_sizes, step)
        return StepTimings(decode, plan.prefill_tokens, step, busy=busy)

    monkeypatch.setattr(dtype_choice, "trial_timings", fixed)
    chosen = dtype_choice.pick_dtype(
        lambda dtype: load(tiny_model_dir, "float32" if dtype == torch.float32 else "bfloat16")
    )
    assert chosen.model.dtype == torch.bfloat16
    scores = {dtype_name(t.dtype): t.score_ms for t in chosen.dtype_choice.trials}
    assert scores == {"bfloat16": pytest.approx(30.0), "float32": pytest.approx(60.0)}
    names = [name for name, _ in runs]
    if disturbed is None:  # nothing disturbed: each candidate timed once
        assert names == ["float32", "bfloat16"]
    else:  # both timed again, back to back, after the second one's trial
        assert names == ["float32", "bfloat16", "float32", "bfloat16"]


def test_auto_on_cpu_measures_both_dtypes_through_the_loader(tiny_model_dir: Path) -> None:
    model = load(tiny_model_dir, "auto")
    choice = model.dtype_choice
    assert choice.source == "measured" and model.model.dtype == choice.dtype
    assert {t.dtype for t in choice.trials} == {torch.float32, torch.bfloat16}
    for trial in choice.trials:
        assert list(trial.timings.decode_ms) == [1, 32]
        assert trial.timings.prefill_tokens == dtype_choice.TRIAL_PREFILL_CHUNK
        assert trial.score_ms > 0


def test_auto_without_a_measurement_is_float32_on_cpu() -> None:
    assert shard_loader.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert shard_loader.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype"):
        shard_loader.resolve_dtype("int3", torch.device("cpu"))


def test_auto_on_cpu_takes_the_quantization_methods_dtype_without_trials(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A method whose CPU kernel runs in one dtype (4-bit GPTQ/AWQ: bf16) is built in it
    # alone; nothing else is built or timed.
    def no_trials(*args: Any) -> None:
        raise AssertionError("the method's dtype needs no trial")

    monkeypatch.setattr(dtype_choice, "trial_timings", no_trials)
    built: list[torch.dtype] = []

    def build(dtype: torch.dtype) -> PagedModel:
        built.append(dtype)
        return load(tiny_model_dir, "bfloat16")

    cpu = torch.device("cpu")
    model = shard_loader.load_paged(build, "auto", torch.float32, cpu, method_dtype=torch.bfloat16)
    assert built == [torch.bfloat16]
    assert (model.dtype_choice.source, model.dtype_choice.trials) == ("quantization", ())
    explicit = shard_loader.load_paged(build, "float32", torch.float32, cpu, torch.bfloat16)
    assert built[-1] == torch.float32 and explicit.dtype_choice.source == "flag"
