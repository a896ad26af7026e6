"""RouterConfig: JSON in, clear ValueErrors for what TGI's router would refuse."""

from __future__ import annotations

import json

import pytest

from textgate.router.config import CPU_STEP_TOKENS, RouterConfig

REQUIRED = {"model_id": "m", "tokenizer_path": "/tok", "shard_uds_path": "/tmp/s"}


def test_from_json_reads_every_field() -> None:
    config = RouterConfig.from_json(
        json.dumps(
            {
                **REQUIRED,
                "port": 9000,
                "max_batch_total_tokens": None,
                "cors_allow_origin": ["https://a.example"],
                "api_key": None,
            }
        )
    )
    assert config.port == 9000
    assert config.cors_allow_origin == ("https://a.example",)
    assert config.max_concurrent_requests == 128 and config.waiting_served_ratio == 0.3


def test_null_cors_means_none() -> None:
    config = RouterConfig.from_json(json.dumps({**REQUIRED, "cors_allow_origin": None}))
    assert config.cors_allow_origin == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not valid JSON"),
        ("[]", "must be a JSON object"),
        (json.dumps({**REQUIRED, "bogus": 1}), "bogus"),
        (json.dumps({"model_id": "m"}), "tokenizer_path"),
    ],
)
def test_bad_json_is_a_value_error(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouterConfig.from_json(text)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_input_tokens": 2048, "max_total_tokens": 2048}, "max_input_tokens"),
        ({"max_batch_total_tokens": 10}, "max_batch_total_tokens"),
        ({"max_concurrent_requests": 0}, "max_concurrent_requests"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"waiting_served_ratio": -1.0}, "waiting_served_ratio"),
        ({"port": 70000}, "port"),
        ({"target_itl_ms": -1.0}, "target_itl_ms"),
        ({"stream_interval": 0}, "stream_interval"),
        ({"max_stream_rate": 0.0}, "max_stream_rate"),
        ({"max_stream_buffer": 0}, "max_stream_buffer"),
        ({"stream_interval": 8, "max_stream_buffer": 4}, "max_stream_buffer .4. must be >="),
    ],
)
def test_inconsistent_limits_are_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouterConfig(**REQUIRED, **overrides)


@pytest.mark.parametrize(
    ("device_type", "expected"),
    [
        ("cpu", CPU_STEP_TOKENS),  # one step of the paged engine on a CPU
        ("cuda", 4095 + 50),  # TGI's default: max_input_tokens + 50
    ],
)
def test_unset_prefill_budget_defaults_by_device(device_type: str, expected: int) -> None:
    config = RouterConfig(**REQUIRED)
    with pytest.raises(RuntimeError, match="unset"):
        _ = config.prefill_tokens
    resolved = config.with_prefill_default(device_type=device_type)
    assert resolved.prefill_tokens == resolved.max_batch_prefill_tokens == expected


def test_a_given_prefill_budget_is_kept() -> None:
    config = RouterConfig(**REQUIRED, max_batch_prefill_tokens=512)
    assert config.with_prefill_default(device_type="cpu").prefill_tokens == 512


def test_prefill_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_batch_prefill_tokens"):
        RouterConfig(**REQUIRED, max_batch_prefill_tokens=0)
