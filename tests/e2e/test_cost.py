"""End to end: --device-hour-cost on the embedded model; /metrics and /info price the tokens
served, per tenant, and without the flag say nothing of costs."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.e2e

KEYS = "keys:\n  - key: sk-a\n    tenant: team-a\n  - key: sk-b\n    tenant: team-b\n"


@pytest.fixture(scope="module")
def priced(launch_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("priced")
    keys = tmp / "keys.yaml"
    keys.write_text(KEYS)
    server = launch_server(
        tmp, "--device-hour-cost", "2.5", "--api-keys-file", str(keys), "--dtype", "float32"
    )
    try:
        server.wait_ready()
        yield server.url
    finally:
        server.stop()


def generate(url: str, key: str | None, prompt: str) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 8, "ignore_eos": True}}
    response = httpx.post(f"{url}/generate", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text


def cost_samples(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if "cost" in line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def positive(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def test_costs_are_positive_finite_and_per_tenant(priced: str) -> None:
    generate(priced, "sk-a", "The capital of France is")
    generate(priced, "sk-b", "Write one short sentence about the sea:")
    values = cost_samples(priced)
    assert values["textgate_device_hour_cost_usd"] == 2.5
    for kind in ("input", "output"):
        assert positive(values[f"textgate_cost_per_1k_{kind}_tokens_usd"])
        for tenant in ("team-a", "team-b"):
            assert positive(
                values[f'textgate_tenant_cost_per_1k_{kind}_tokens_usd{{tenant="{tenant}"}}']
            )
    assert values['textgate_cost_tokens{kind="output"}'] == 16
    cost = httpx.get(f"{priced}/info").json()["cost"]
    assert cost["device_hour_cost_usd"] == 2.5
    assert positive(cost["window"]["per_1k_input_tokens_usd"])
    assert positive(cost["window"]["per_1k_output_tokens_usd"])
    assert cost["lifetime"]["output_tokens"] == 16
    assert set(cost["tenants"]) == {"team-a", "team-b"}
    assert cost["tenants"]["team-a"]["output_tokens"] == 8


def test_without_the_flag_nothing_is_reported(live_server: str) -> None:
    generate(live_server, None, "The capital of France is")
    assert cost_samples(live_server) == {}
    assert httpx.get(f"{live_server}/info").json()["cost"] is None
