"""Startup measurements: the probe's geometry, timing until stable, telling a busy machine,
and a tiny model's warmup."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.loading import shard_loader
from textgate.shard_server.loading.shard_loader import load_model
from textgate.shard_server.protocols.paged_model import CacheConfig, PagedModel
from textgate.shard_server.startup import step_timing
from textgate.shard_server.startup.step_timing import (
    Contention,
    CpuSample,
    ProbePlan,
    StepTimings,
    Timing,
)

SMALL_CACHE = CacheConfig(block_size=16, kv_cache_memory=8 << 20)


def timings(decode: dict[int, float], prefill_ms: float, tokens: int = 128) -> StepTimings:
    return StepTimings(decode_ms=decode, prefill_tokens=tokens, prefill_ms=prefill_ms)


# -- what is measured ------------------------------------------------------------------------


def test_decode_batch_sizes_go_up_to_the_max_batch_within_the_cache() -> None:
    assert step_timing.decode_batch_sizes(0, 1000) == [1, 8, 32]
    assert step_timing.decode_batch_sizes(4, 1000) == [1, 4]
    assert step_timing.decode_batch_sizes(64, 1000) == [1, 8, 32, 64]
    assert step_timing.decode_batch_sizes(0, 20) == [1, 8, 20]
    assert step_timing.decode_batch_sizes(4096, 10_000) == [1, 8, 32, 256]
    with pytest.raises(ValueError, match="cannot hold"):
        step_timing.decode_batch_sizes(0, 0)


def test_the_probe_fits_the_cache_and_the_model_positions() -> None:
    plan = ProbePlan.fit([1, 8, 32], 512, num_blocks=100, block_size=16, max_positions=4096)
    # 128 + 10 tokens (one per run, MAX_RUNS) take 9 blocks: 11 sequences fit, not 32.
    assert plan == ProbePlan(batch_sizes=(1, 8), context=128, prefill_tokens=512)
    assert plan.num_blocks(16) == 72
    short = ProbePlan.fit([1], 512, num_blocks=100, block_size=16, max_positions=64)
    assert (short.context, short.prefill_tokens) == (64 - step_timing.MAX_RUNS - 1, 63)
    with pytest.raises(ValueError, match="cannot hold"):
        ProbePlan.fit([1], 64, num_blocks=5, block_size=16, max_positions=4096)


# -- timing until stable --------------------------------------------------------------------


def scripted(times: Iterable[float]) -> tuple[Any, list[int]]:
    """A step whose runs take `times` ms in turn (the first is the untimed run), and the
    run indices it was called with."""
    script, calls = iter(times), []

    def run(index: int) -> float:
        calls.append(index)
        return next(script)

    return run, calls


def test_a_busy_start_then_a_quiet_machine_reports_the_quiet_time() -> None:
    # Three runs while another process comes and goes on the CPU (contention is uneven),
    # then two quiet ones that agree: the median of three (the old rule) said 300 ms.
    run, calls = scripted([900.0, 300.0, 250.0, 340.0, 100.0, 104.0, 99.0])
    assert step_timing.time_until_stable(run) == Timing(100.0, num_runs=5, stable=True)
    assert calls == [0, 1, 2, 3, 4, 5]  # the untimed run, then until the two fastest agree


def test_a_quiet_machine_stops_after_the_fewest_runs() -> None:
    run, calls = scripted([50.0, 20.4, 20.0, 21.0, 5.0])
    assert step_timing.time_until_stable(run) == Timing(20.0, num_runs=3, stable=True)
    assert len(calls) == 1 + step_timing.MIN_RUNS


def test_runs_that_never_agree_stop_at_the_cap_and_say_so() -> None:
    # Each run 20 % slower than the last: the two fastest never agree within 10 %.
    run, calls = scripted([10.0 * 1.2**i for i in range(50)])
    timing = step_timing.time_until_stable(run)
    assert timing == Timing(12.0, num_runs=step_timing.MAX_RUNS, stable=False)
    assert calls == list(range(step_timing.MAX_RUNS + 1))


def test_a_slow_noisy_step_stops_once_its_runs_took_the_time_cap() -> None:
    # Runs 450-700 ms that never agree: past MIN_RUNS they stop once they took 2 s.
    run, _ = scripted([500.0, 700.0, 450.0, 600.0, 520.0, 460.0, 455.0])
    assert sum([700.0, 450.0, 600.0]) < step_timing.MAX_STEP_MS <= sum([700, 450, 600, 520])
    assert step_timing.time_until_stable(run) == Timing(450.0, num_runs=4, stable=False)
    # A step slower than the cap alone still gets MIN_RUNS runs.
    run, _ = scripted([3000.0, 2500.0, 4000.0, 3000.0, 2400.0])
    assert step_timing.time_until_stable(run) == Timing(2500.0, num_runs=3, stable=False)


# -- a busy machine --------------------------------------------------------------------------


def cpu(wall_s: float, all_busy_s: float | None, own_s: float) -> CpuSample:
    return CpuSample(wall_s=wall_s, all_busy_s=all_busy_s, own_s=own_s, num_cpus=2)


def test_other_processes_on_our_cpus_make_the_machine_busy() -> None:
    device = torch.device("cpu")
    start = cpu(0.0, 100.0, 5.0)
    # Over 2 s of 2 CPUs (4 CPU-seconds) this process used 1.9, everything 3.1: others 1.2.
    busy = Contention.between(start, cpu(2.0, 103.1, 6.9), None, device)
    assert busy.other_cpu_share == pytest.approx(0.3) and busy.busy
    assert "other processes used 30% of its 2 CPUs" in busy.describe()
    quiet = Contention.between(start, cpu(2.0, 102.1, 6.9), None, device)
    assert quiet.other_cpu_share == pytest.approx(0.05) and not quiet.busy
    # Too short a window for 10 ms ticks, or no /proc/stat: unknown, not busy.
    assert Contention.between(start, cpu(0.1, 101.0, 5.0), None, device).other_cpu_share is None
    assert Contention.between(cpu(0.0, None, 0.0), cpu(2.0, None, 1.0), None, device).busy is False


def test_steps_that_never_agreed_make_the_machine_busy() -> None:
    unsteady = Contention(None, 1.0, 2, unstable=("decode at batch 32",))
    assert unsteady.busy
    assert "decode at batch 32: runs never agreed within 10%" in unsteady.describe()


def test_the_cpu_sample_reads_this_machine() -> None:
    sample = CpuSample.now()
    assert sample.num_cpus >= 1 and sample.own_s > 0
    if Path("/proc/stat").exists():
        assert sample.all_busy_s is not None and sample.all_busy_s > 0


# -- a tiny model ----------------------------------------------------------------------------


def load(path: Path, dtype: str) -> PagedModel:
    model = load_model(path, "tiny", dtype, cache_config=SMALL_CACHE)
    assert isinstance(model, PagedModel)
    return model


def test_warmup_measures_the_step_and_reports_an_explicit_dtype(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_trials(*args: Any) -> None:
        raise AssertionError("an explicit dtype measures no other dtype")

    monkeypatch.setattr(shard_loader, "pick_dtype", no_trials)
    model = load(tiny_model_dir, "bfloat16")
    warm = model.warmup(pb.WarmupRequest(max_prefill_tokens=48, max_batch_size=0))
    assert [t.batch_size for t in warm.decode_timings] == [1, 8, 32]
    assert all(0 < t.step_ms < 10_000 for t in warm.decode_timings)
    assert warm.prefill_chunk_tokens == 48 and warm.prefill_tokens_per_s > 0
    assert 0 < warm.measure_ms < 60_000 and warm.num_threads == torch.get_num_threads()
    assert warm.device_name
    assert (warm.dtype, warm.dtype_source, len(warm.dtype_trials)) == ("bfloat16", "flag", 0)
    assert warm.num_blocks > 0 and not model.sequences  # the probe's sequences are gone
    smaller = model.warmup(pb.WarmupRequest(max_prefill_tokens=16, max_batch_size=4))
    assert [t.batch_size for t in smaller.decode_timings] == [1, 4]


def scripted_steps(
    monkeypatch: pytest.MonkeyPatch, times: list[float]
) -> list[tuple[list[pb.Request], pb.StepPlan]]:
    """Every probe step runs in the real model, but is said to take `times` ms in turn
    (cycling); the CPU share is unknown, so only the runs tell a busy machine."""
    script, steps = itertools.cycle(times), []
    real = step_timing._timed_step

    def timed(model: PagedModel, new: list[pb.Request], plan: pb.StepPlan) -> float:
        steps.append((new, plan))
        real(model, new, plan)
        return next(script)

    monkeypatch.setattr(step_timing, "_timed_step", timed)
    monkeypatch.setattr(step_timing, "_busy_seconds", lambda cpus: None)
    return steps


def test_warmup_reports_the_quiet_runs_of_a_machine_busy_at_first(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Every measured step: an untimed run, three uneven busy runs, then two quiet ones that
    # agree (each step takes six: the script stays in step with them).
    scripted_steps(monkeypatch, [900.0, 30.0, 25.0, 34.0, 10.0, 10.5])
    model = load(tiny_model_dir, "bfloat16")
    with caplog.at_level(logging.INFO, logger="textgate.shard"):
        warm = model.warmup(pb.WarmupRequest(max_prefill_tokens=48, max_batch_size=0))
    assert {t.batch_size: t.step_ms for t in warm.decode_timings} == {1: 10.0, 8: 10.0, 32: 10.0}
    assert warm.prefill_tokens_per_s == pytest.approx(48 / 10.0 * 1e3)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_warmup_says_when_the_machine_looked_busy(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Runs that never agree: every step is timed MAX_RUNS times through the real model
    # (the probe's positions and blocks hold that many), in each of the 1 + BUSY_RETRIES
    # tries, and the shard says it was busy.
    steps = scripted_steps(monkeypatch, [10.0 * 1.2**i for i in range(step_timing.MAX_RUNS + 1)])
    monkeypatch.setattr(step_timing, "BUSY_RETRY_PAUSE_S", 0.0)
    model = load(tiny_model_dir, "bfloat16")
    with caplog.at_level(logging.INFO, logger="textgate.shard"):
        warm = model.warmup(pb.WarmupRequest(max_prefill_tokens=48, max_batch_size=4))
    assert [t.step_ms for t in warm.decode_timings] == [12.0, 12.0]  # the fastest run
    tries = 1 + step_timing.BUSY_RETRIES
    assert len(steps) == tries * 3 * (step_timing.MAX_RUNS + 1)  # batch 1, batch 4, prefill
    last_decode = steps[2 * (step_timing.MAX_RUNS + 1) - 1][1].scheduled[0]
    assert last_decode.start_position == step_timing.DECODE_CONTEXT - 1 + step_timing.MAX_RUNS
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "looked busy" in warning and "decode at batch 4: runs never agreed" in warning
    assert f"{tries} times" in warning
    assert any("on a machine that looked busy" in r.getMessage() for r in caplog.records)
    assert not model.sequences


def test_a_busy_measurement_is_timed_again_and_keeps_each_steps_fastest(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The first try's runs never agree (a busy machine: 40 ms and up); the second try's
    # agree at 12 ms, which the router gets, and nothing is logged as a warning.
    runs = step_timing.MAX_RUNS + 1
    busy = [40.0 * 1.2**i for i in range(runs)]
    quiet = [500.0, 12.0, 12.5, 12.2]
    times = busy * 3 + quiet * 3  # batch 1, batch 4, the prefill: each try
    steps = scripted_steps(monkeypatch, times)
    monkeypatch.setattr(step_timing, "BUSY_RETRY_PAUSE_S", 0.0)
    model = load(tiny_model_dir, "bfloat16")
    with caplog.at_level(logging.INFO, logger="textgate.shard"):
        warm = model.warmup(pb.WarmupRequest(max_prefill_tokens=48, max_batch_size=4))
    assert len(steps) == len(times)
    assert [t.step_ms for t in warm.decode_timings] == [12.0, 12.0]
    assert warm.prefill_tokens_per_s == pytest.approx(48 / 12.0 * 1e3)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not model.sequences
