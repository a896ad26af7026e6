"""The router's defaults from the shards' measured step: the rules, explicit flags winning,
resolve_config, and the report under /info."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from textgate.proto import generate_pb2 as pb
from textgate.router import autoconfig
from textgate.router.autoconfig import Measurements
from textgate.router.config import CPU_STEP_TOKENS, RouterConfig
from textgate.router.engine.batch_controller import BatchController
from textgate.router.engine.factory import describe_controller, scheduler_config, startup_steps
from textgate.router.server import resolve_config
from textgate.tests.router.fake_shard import FakeShard

# A CPU-like step: 25 ms of overhead plus 4 ms per sequence (an exact line).
CPU_STEPS = {1: 29.0, 8: 57.0, 32: 153.0}
# A GPU-like step: batching is nearly free.
GPU_STEPS = {1: 8.0, 8: 8.2, 32: 9.0}
PAGED_CPU = pb.InfoResponse(dtype="float32", device_type="cpu", block_size=16)


def measured(steps: dict[int, float], prefill_tokens_per_s: float = 2000.0) -> Measurements:
    return Measurements(
        decode_step_ms=steps,
        prefill_tokens_per_s=prefill_tokens_per_s,
        prefill_chunk_tokens=256,
        measure_ms=900.0,
        device_name="Test CPU",
        num_threads=2,
        dtype="bfloat16",
        dtype_source="measured",
    )


def config(**overrides: Any) -> RouterConfig:
    fields: dict[str, Any] = {"model_id": "m", "tokenizer_path": "t", **overrides}
    return RouterConfig(**fields)


# -- the rules ---------------------------------------------------------------------------


def test_the_reference_batch_is_the_largest_measured_within_the_max_batch() -> None:
    m = measured(CPU_STEPS)
    assert autoconfig.reference_batch(m, None) == 32
    assert autoconfig.reference_batch(m, 8) == 8
    assert autoconfig.reference_batch(m, 20) == 8
    assert autoconfig.reference_batch(m, 4) == 1


def test_the_target_leaves_a_loaded_step_room_for_prompts_on_a_cpu() -> None:
    # 1.5 x the batch-32 step (229.5) beats 4 x the batch-1 step (116).
    assert autoconfig.target_itl_ms(measured(CPU_STEPS), 32) == 229.5


def test_the_target_is_a_multiple_of_the_batch1_step_where_batching_is_free() -> None:
    assert autoconfig.target_itl_ms(measured(GPU_STEPS), 32) == 32.0
    assert autoconfig.target_itl_ms(measured({1: 2.0, 32: 3.0}), 32) == 20.0  # the floor


def test_the_max_batch_is_where_the_fitted_step_meets_the_target() -> None:
    m = measured(CPU_STEPS)
    assert autoconfig.max_batch_size(m, 229.5, 32) == 51  # (229.5 - 25) / 4
    assert autoconfig.max_batch_size(m, 100.0, 32) == 32  # never below the reference
    flat = measured({1: 10.0, 8: 9.0, 32: 9.5})
    assert autoconfig.max_batch_size(flat, 40.0, 32) == autoconfig.MAX_DERIVED_BATCH_SIZE
    assert autoconfig.max_batch_size(measured({1: 10.0}), 40.0, 1) == 256


def test_the_step_budget_is_the_batch_plus_the_prompt_tokens_of_the_headroom() -> None:
    m = measured(CPU_STEPS, prefill_tokens_per_s=2000.0)
    # 32 decodes + (229.5 - 153) ms x 2 tokens/ms = 185, down to a multiple of 16.
    tokens = autoconfig.step_tokens(
        m, 229.5, 32, batch_size=51, block_size=16, max_input_tokens=4095
    )
    assert tokens == 176
    # No headroom: the floor; a larger batch than that: the batch.
    args: dict[str, Any] = {"block_size": 16, "max_input_tokens": 4095}
    assert autoconfig.step_tokens(m, 150.0, 32, batch_size=32, **args) == 64
    assert autoconfig.step_tokens(m, 150.0, 32, batch_size=100, **args) == 100
    # A fast prefill: TGI's max_input_tokens + 50 bounds it.
    fast = measured(GPU_STEPS, prefill_tokens_per_s=1e6)
    assert autoconfig.step_tokens(fast, 32.0, 32, batch_size=256, **args) == 4145


def test_unset_settings_derive_from_the_measurements() -> None:
    resolved = autoconfig.apply_measurements(config(), measured(CPU_STEPS), block_size=16)
    assert resolved.max_batch_size == 51
    # 32 decodes + (2 x 229.5 - 153) ms x 2 tokens/ms: room for the controller's longest
    # step (a catch-up with waiting prompts, MAX_STRETCH targets); fixed budgets get 176.
    assert resolved.max_batch_prefill_tokens == 640
    # The target is the batch controller's: it starts at 229.5 ms and follows served steps.
    assert resolved.target_itl_ms is None
    assert autoconfig.derive(config(), measured(CPU_STEPS), 16).target_itl_ms == 229.5


def test_explicit_flags_win_and_the_rest_derive_around_them() -> None:
    m = measured(CPU_STEPS)
    given = config(target_itl_ms=300.0, max_batch_size=8, max_batch_prefill_tokens=999)
    assert autoconfig.apply_measurements(given, m, 16) == given
    # An explicit target sizes the budget; an explicit max batch picks the reference.
    resolved = autoconfig.apply_measurements(config(target_itl_ms=300.0), m, 16)
    assert resolved.target_itl_ms == 300.0
    assert resolved.max_batch_size == 68  # (300 - 25) / 4
    assert resolved.max_batch_prefill_tokens == 912  # 32 + (2 x 300 - 153) x 2, to 16s
    small = autoconfig.derive(config(max_batch_size=8), m, 16)
    assert small.max_batch_size == 8
    assert small.target_itl_ms == 116.0  # 4 x step(1) > 1.5 x step(8)


def test_fixed_budgets_keep_their_zero_target() -> None:
    resolved = autoconfig.apply_measurements(config(target_itl_ms=0.0), measured(CPU_STEPS), 16)
    assert resolved.target_itl_ms == 0.0
    assert resolved.max_batch_prefill_tokens == 176  # sized around the derived target


def test_measurements_come_from_a_warmup_answer_or_not_at_all() -> None:
    assert Measurements.from_warmup(pb.WarmupResponse(num_blocks=10)) is None
    warmup = pb.WarmupResponse(
        decode_timings=[pb.DecodeTiming(batch_size=8, step_ms=5), pb.DecodeTiming(batch_size=1, step_ms=4)],
        prefill_tokens_per_s=1000,
        dtype="float32",
        dtype_source="flag",
    )  # fmt: skip
    m = Measurements.from_warmup(warmup)
    assert m is not None and list(m.decode_step_ms) == [1, 8]
    with pytest.raises(ValueError, match="batch size 1"):
        measured({8: 5.0})
    with pytest.raises(ValueError, match="positive"):
        measured({1: 5.0}, prefill_tokens_per_s=0.0)


def test_resolve_config_derives_only_with_measurements() -> None:
    requested = config(max_batch_prefill_tokens=None)
    derived = resolve_config(requested, PAGED_CPU, 100_000, measured(CPU_STEPS))
    assert (derived.prefill_tokens, derived.max_batch_size) == (640, 51)
    static = resolve_config(requested, PAGED_CPU, 100_000)
    assert static.prefill_tokens == CPU_STEP_TOKENS and static.max_batch_size is None
    assert static.target_itl_ms is None


def test_the_report_names_each_choice_and_its_source(caplog: pytest.LogCaptureFixture) -> None:
    requested = config(max_batch_size=8)
    m = measured(CPU_STEPS)
    report = autoconfig.report(requested, autoconfig.apply_measurements(requested, m, 16), m)
    assert report["max_batch_size"] == {"value": 8, "source": "flag"}
    assert report["target_itl_ms"] == {"value": 116.0, "source": "measured"}
    assert report["reference_batch_size"] == 8
    assert report["measured"]["decode_step_ms"][0] == {"batch_size": 1, "step_ms": 29.0}
    with caplog.at_level(logging.INFO, logger="textgate.router"):
        autoconfig.log_report(report)
    (block,) = [r.getMessage() for r in caplog.records if "autoconfig" in r.getMessage()]
    assert "Test CPU (2 threads)" in block and "max_batch_size 8 (flag)" in block


# -- the batch controller starts where the rules put the target -----------------------------


def test_the_controller_seeded_with_the_warmup_starts_at_the_reported_target() -> None:
    resolved = resolve_config(config(), PAGED_CPU, 100_000, measured(CPU_STEPS))
    paged = scheduler_config(resolved, PAGED_CPU.block_size, 1000)
    startup = startup_steps(WARMUP_MEASUREMENTS)
    controller = BatchController(paged.controller_config(), startup=startup)
    report = autoconfig.report(config(), resolved, measured(CPU_STEPS))
    # CPU_STEPS is an exact line, so the seeded fit's steps are the measured ones (within
    # the fit's light ridge).
    assert controller.target_itl_s is not None
    assert report["target_itl_ms"] == {"value": 229.5, "source": "measured"}
    assert controller.target_itl_s * 1e3 == pytest.approx(229.5, rel=0.01)
    assert paged.target_itl_s is None  # not frozen: the controller re-derives it
    assert describe_controller(paged, controller.target_itl_s).startswith(
        "adaptive, inter-token latency target derived from measured steps, 22"
    )


def test_an_explicit_target_is_kept_and_the_seed_only_informs_the_fit() -> None:
    resolved = resolve_config(config(target_itl_ms=80.0), PAGED_CPU, 100_000, measured(CPU_STEPS))
    paged = scheduler_config(resolved, PAGED_CPU.block_size, 1000)
    controller = BatchController(
        paged.controller_config(), startup=startup_steps(WARMUP_MEASUREMENTS)
    )
    assert controller.target_itl_s == 0.08 and controller.cost.is_ready
    assert controller.cost.predict(32) == pytest.approx(0.153, rel=0.01)
    assert startup_steps(pb.WarmupResponse(num_blocks=10)) is None


# -- over the fake shard -------------------------------------------------------------------

WARMUP_MEASUREMENTS = pb.WarmupResponse(
    decode_timings=[pb.DecodeTiming(batch_size=b, step_ms=ms) for b, ms in CPU_STEPS.items()],
    prefill_tokens_per_s=2000.0,
    prefill_chunk_tokens=256,
    measure_ms=900.0,
    device_name="Test CPU",
    num_threads=2,
    dtype="bfloat16",
    dtype_source="measured",
    dtype_trials=[
        pb.DtypeTrial(dtype="bfloat16", score_ms=200.0, prefill_chunk_tokens=128),
        pb.DtypeTrial(dtype="float32", score_ms=250.0, prefill_chunk_tokens=128),
    ],
)


async def test_info_shows_the_autoconfig_report(
    fake: FakeShard, start_router: Callable[..., Awaitable[str]]
) -> None:
    fake.warmup_measurements = WARMUP_MEASUREMENTS
    url = await start_router(
        max_batch_prefill_tokens=None, max_input_tokens=1000, max_total_tokens=4096
    )
    async with httpx.AsyncClient(base_url=url) as client:
        info = (await client.get("/info")).json()
    assert info["max_batch_size"] == 51  # TGI's field carries the derived value
    report = info["autoconfig"]
    assert report["device"] == "Test CPU"
    assert report["dtype"]["value"] == "bfloat16"
    assert [t["dtype"] for t in report["dtype"]["trials"]] == ["bfloat16", "float32"]
    assert report["max_batch_prefill_tokens"] == {"value": 640, "source": "measured"}
    assert report["target_itl_ms"] == {"value": 229.5, "source": "measured"}
    assert fake.calls_to("Warmup")[0].max_batch_size == 0  # unset: the shard's default


async def test_info_has_no_report_without_measurements(
    fake: FakeShard, start_router: Callable[..., Awaitable[str]]
) -> None:
    url = await start_router()
    async with httpx.AsyncClient(base_url=url) as client:
        info = (await client.get("/info")).json()
    assert info["autoconfig"] is None
