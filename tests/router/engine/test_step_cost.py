"""StepCostModel: the online least-squares fit of step latency to the step's token counts."""

from __future__ import annotations

import random

import pytest

from textgate.router.engine.step_cost import StepCostModel, attention_pairs


def curve(num_decodes: int, num_prefill: int) -> float:
    return 0.005 + 0.0008 * num_decodes + 0.0004 * num_prefill


def test_fit_recovers_the_curve_from_noisy_varied_steps() -> None:
    model, rng = StepCostModel(), random.Random(0)
    for _ in range(200):
        n, p = rng.randint(1, 40), rng.choice([0, 0, rng.randint(1, 200)])
        model.add(n, p, curve(n, p) + rng.gauss(0, 0.0005))
    overhead, per_decode, per_prefill, per_attention = model.coefficients
    assert overhead == pytest.approx(0.005, rel=0.1)
    assert per_decode == pytest.approx(0.0008, rel=0.05)
    assert per_prefill == pytest.approx(0.0004, rel=0.05)
    assert per_attention == pytest.approx(0.0, abs=1e-6)  # these steps cost no attention
    assert model.largest_batch(0.030, 0, limit=256) == 31  # 5 + 0.8 * 31 = 29.8 ms
    assert model.largest_batch(0.030, 16, limit=256) == 23  # with 6.4 ms of prompt
    assert model.largest_batch(0.030, 0, limit=10) == 10
    assert model.largest_batch(0.004, 0, limit=256) == 0
    assert model.prefill_tokens_within(0.030, 20, limit=512) in range(21, 24)  # 9 ms / 0.4
    assert model.prefill_tokens_within(0.030, 40, limit=512) == 0
    # What the controller's debug lines show of the fit.
    assert model.describe().startswith(
        f"{overhead * 1e3:.2f} ms + {per_decode * 1e3:.3f} ms/decode"
    )


def test_a_steady_batch_keeps_the_slopes_it_learned() -> None:
    model, rng = StepCostModel(), random.Random(1)
    for _ in range(100):
        n = rng.randint(1, 40)
        model.add(n, 0, curve(n, 0))
    # 500 steps at one batch size tell overhead and slope nothing apart.
    for _ in range(500):
        model.add(31, 0, curve(31, 0) + rng.gauss(0, 0.0005))
    assert model.coefficients[1] == pytest.approx(0.0008, rel=0.05)
    assert model.predict(10) == pytest.approx(curve(10, 0), rel=0.05)


def test_fit_follows_a_machine_that_gets_slower() -> None:
    model = StepCostModel()
    for n in range(1, 41):
        model.add(n, 0, curve(n, 0))
    for n in list(range(1, 41)) * 2:
        model.add(n, 0, 2 * curve(n, 0))
    assert model.predict(20) == pytest.approx(2 * curve(20, 0), rel=0.05)


def test_one_stalled_step_does_not_bend_the_fit_and_a_real_slowdown_still_does() -> None:
    model, rng = StepCostModel(), random.Random(2)
    for _ in range(60):
        n, p = rng.randint(1, 64), rng.choice([0, 32])
        model.add(n, p, curve(n, p))
    # The router's loop was busy with a burst of arrivals: one small step took 0.4 s.
    # Counted in full it would make the fit's per-decode cost 0 (64 decodes predicted at
    # 24 ms instead of 56); counted as 3x its prediction, it moves the fit a little.
    model.add(1, 32, 0.4)
    assert model.predict(17, 32) == pytest.approx(curve(17, 32), rel=0.15)
    assert model.predict(64) == pytest.approx(curve(64, 0), rel=0.15)
    # The machine gets 4x slower: the fit follows within a few dozen steps.
    for _ in range(40):
        n = rng.randint(1, 64)
        model.add(n, 0, 4 * curve(n, 0))
    assert model.predict(32) == pytest.approx(4 * curve(32, 0), rel=0.1)


def test_a_step_past_what_the_fit_has_seen_counts_in_full() -> None:
    model = StepCostModel()
    for n in range(1, 21):
        model.add(n, 0, curve(n, 0))
    # Its first prompt chunk: far over a prediction that knows no prompt tokens' cost.
    for _ in range(3):
        model.add(4, 256, curve(4, 256))
    assert model.predict(4, 256) == pytest.approx(curve(4, 256), rel=0.2)


def test_unmeasured_model_is_not_ready_and_predicts_nothing_costs() -> None:
    model = StepCostModel(min_samples=3)
    assert not model.is_ready and model.predict(10, 10) == 0
    assert model.largest_batch(0.01, 0, limit=7) == 7
    for _ in range(3):
        model.add(1, 0, 0.01)
    assert model.is_ready


@pytest.mark.parametrize(
    ("args", "message"),
    [((-1, 0, 0.01), "token counts"), ((1, 0, float("nan")), "finite"), ((1, 0, -1.0), ">= 0")],
)
def test_bad_samples_are_refused(args: tuple[int, int, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StepCostModel().add(*args)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"forgetting": 0.0}, "forgetting"), ({"ridge": 0.0}, "ridge"), ({"min_samples": 0}, "min")],
)
def test_bad_settings_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StepCostModel(**kwargs)  # type: ignore[arg-type]


def attention_curve(num_decodes: int, chunks: list[tuple[int, int]]) -> float:
    """A step whose prompt chunks (start, tokens) also pay for the keys before them."""
    pairs = sum(attention_pairs(start, n) for start, n in chunks)
    # Per thousand pairs about what a token costs: as measured on a 2-core CPU.
    return curve(num_decodes, sum(n for _, n in chunks)) + 0.0005 * pairs


def fitted_to_attention_steps(seed: int, noise_s: float) -> StepCostModel:
    """A fit of 300 steps of 1-16 decodes, most with one prompt chunk somewhere in the first
    3,000 positions, timed on `attention_curve` (plus gaussian noise of `noise_s`)."""
    model, rng = StepCostModel(), random.Random(seed)
    for _ in range(300):
        n = rng.randint(1, 16)
        chunks = [(rng.randrange(0, 3000, 16), rng.randint(16, 128))] if rng.random() < 0.6 else []
        pairs = sum(attention_pairs(s, c) for s, c in chunks)
        latency = attention_curve(n, chunks) + (rng.gauss(0, noise_s) if noise_s else 0.0)
        model.add(n, sum(c for _, c in chunks), latency, prefill_attention=pairs)
    return model


def test_fit_learns_what_a_chunk_pays_for_the_keys_before_it() -> None:
    model = fitted_to_attention_steps(seed=2, noise_s=0.0003)
    assert model.coefficients[3] == pytest.approx(0.0005, rel=0.1)
    assert model.predict(8, 80, context=2800) == pytest.approx(
        attention_curve(8, [(2800, 80)]), rel=0.05
    )
    # Deeper into a long prompt, fewer of its tokens fit beside the same decodes.
    early = model.prefill_tokens_within(0.200, 8, limit=512, context=0)
    late = model.prefill_tokens_within(0.200, 8, limit=512, context=2800)
    assert late < early / 2
    # The budget is the largest count predicted within the target, not a looser bound.
    for context, tokens in ((0, early), (2800, late)):
        assert model.predict(8, tokens, context) <= 0.200 < model.predict(8, tokens + 1, context)


def test_prompt_tokens_within_is_the_largest_chunk_whose_prompt_cost_fits() -> None:
    model = fitted_to_attention_steps(seed=4, noise_s=0.0)
    cost = model.prompt_cost(32)
    assert model.prompt_tokens_within(cost + 1e-9, 512) == 32
    deep = model.prompt_tokens_within(cost, 512, context=2500)
    assert 0 < deep < 32 / 3  # each token there attends over 2,500 keys
    assert model.prompt_cost(deep, attention_pairs(2500, deep)) <= cost
    assert model.prompt_cost(deep + 1, attention_pairs(2500, deep + 1)) > cost
    assert model.prompt_tokens_within(0.0, 512) == 0
    assert model.prompt_tokens_within(1.0, 5) == 5


def test_decode_spread_is_the_weighted_deviation_of_the_recent_batches() -> None:
    model = StepCostModel()
    assert model.decode_spread() == 0.0
    model.seed([(1, 0, 0.006), (32, 0, 0.030)])
    assert model.decode_spread() == 0.0  # the seed is a prior, not served steps
    for _ in range(100):
        model.add(8, 0, 0.014)
    assert model.decode_spread() == pytest.approx(0.0, abs=1e-6)
    for n in (1, 32) * 10:
        model.add(n, 0, 0.006 + 0.0008 * n)
    assert model.decode_spread() > 10


def test_attention_pairs_count_every_query_and_its_keys() -> None:
    assert attention_pairs(0, 1) == pytest.approx(0.001)  # one query, one key
    assert attention_pairs(0, 4) == pytest.approx((1 + 2 + 3 + 4) / 1000)
    assert attention_pairs(10, 2) == pytest.approx((11 + 12) / 1000)
