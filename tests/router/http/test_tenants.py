"""The key file: YAML and JSON, plaintext and hashed keys, clear errors, and reloads that
keep the keys in force when the new file is bad."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

from textgate.router.config import RouterConfig
from textgate.router.engine.quota import Limits
from textgate.router.http.tenants import (
    DEFAULT_TENANT,
    Tenants,
    load_keys_file,
    parse_keys_file,
)

YAML = """
keys:
  - key: sk-team-a
    tenant: team-a
    requests_per_minute: 60
    tokens_per_minute: 20000
    max_concurrent: 8
    max_new_tokens: 1024
    priority: 0
    weight: 1.0
    models: [base, my-adapter]
  - key_sha256: {digest}
    tenant: team-b
"""


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_a_yaml_file_maps_keys_to_tenants_and_their_limits() -> None:
    table = parse_keys_file(YAML.format(digest=digest("sk-team-b")), "keys.yaml")
    assert table.tenant_of("sk-team-a") == "team-a"
    assert table.tenant_of("sk-team-b") == "team-b"
    assert table.tenant_of("sk-team-c") is None
    assert table.limits["team-a"] == Limits(
        requests_per_minute=60,
        tokens_per_minute=20000,
        max_concurrent=8,
        max_new_tokens=1024,
        priority=0,
        weight=1.0,
        models=frozenset({"base", "my-adapter"}),
    )
    assert table.limits["team-b"] == Limits()
    # Only digests are kept, never the plaintext key.
    assert all(len(d) == 32 for d, _ in table.digests)
    assert "sk-team-a" not in repr(table)


def test_a_json_file_and_an_upper_case_digest(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    entries = [{"key_sha256": digest("k1").upper(), "tenant": "t", "max_concurrent": 2}]
    path.write_text(json.dumps({"keys": entries}))
    table = load_keys_file(str(path))
    assert table.tenant_of("k1") == "t"
    assert table.limits["t"].max_concurrent == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("keys: [", "not valid YAML"),
        ("keys: []", "keys: List should have at least 1 item"),
        ("keys:\n  - tenant: t", "give exactly one of `key` and `key_sha256`"),
        ("keys:\n  - {key: a, key_sha256: " + "ab" * 32 + ", tenant: t}", "exactly one"),
        ("keys:\n  - {key_sha256: abc, tenant: t}", "64 hex digits"),
        ("keys:\n  - {key: a}", "keys.0.tenant: Field required"),
        ("keys:\n  - {key: a, tenant: t, requests_per_minute: 0}", "keys.0.requests_per_minute"),
        ("keys:\n  - {key: a, tenant: t, rpm: 5}", "keys.0.rpm: Extra inputs"),
        ("keys:\n  - {key: a, tenant: t}\n  - {key: a, tenant: u}", "keys.1: the same key"),
        (
            "keys:\n  - {key: a, tenant: t, max_concurrent: 1}\n  - {key: b, tenant: t}",
            "keys.1: tenant `t` is given other limits",
        ),
        ("- key: a", "file: Input should be a valid dictionary"),
    ],
)
def test_bad_files_name_the_file_and_the_entry(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"^keys\.yaml: ") as error:
        parse_keys_file(text, "keys.yaml")
    assert message in str(error.value)


def test_bad_json_and_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"keys\.json: not valid JSON"):
        parse_keys_file("{keys: []}", "keys.json")
    with pytest.raises(ValueError, match="cannot read the API keys file"):
        load_keys_file(str(tmp_path / "missing.yaml"))


def config(**fields: object) -> RouterConfig:
    return RouterConfig(model_id="m", tokenizer_path="unused", **fields)  # type: ignore[arg-type]


def test_no_key_and_no_file_is_open_and_api_key_is_the_default_tenant(tmp_path: Path) -> None:
    assert Tenants.from_config(config()) is None
    alone = Tenants.from_config(config(api_key="secret"))
    assert alone is not None and alone.names == (DEFAULT_TENANT,)
    path = tmp_path / "keys.yaml"
    path.write_text(
        "keys:\n  - {key: sk-a, tenant: a}\n  - {key: sk-d, tenant: default, max_concurrent: 3}"
    )
    both = Tenants.from_config(config(api_key="secret", api_keys_file=str(path)))
    assert both is not None and both.names == ("a", DEFAULT_TENANT)
    secret = both.authenticate("secret")
    assert secret is not None and secret.name == DEFAULT_TENANT
    # The file's limits for "default" are the --api-key's too.
    assert secret.limits.max_concurrent == 3
    assert both.authenticate("sk-a") is not None
    assert both.authenticate("") is None and both.authenticate(None) is None
    assert both.authenticate("sk-b") is None


def test_reload_swaps_the_keys_and_a_bad_file_keeps_the_old_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n  - {key: old, tenant: a, requests_per_minute: 5}")
    tenants = Tenants.from_config(config(api_keys_file=str(path)))
    assert tenants is not None
    quota = tenants.authenticate("old")
    assert quota is not None
    path.write_text(
        "keys:\n  - {key: new, tenant: a, requests_per_minute: 9}\n  - {key: b, tenant: b}"
    )
    assert tenants.reload()
    assert tenants.authenticate("old") is None
    # The same tenant keeps its quota object (its usage, its requests in flight).
    assert tenants.authenticate("new") is quota and quota.limits.requests_per_minute == 9
    path.write_text("keys: [")
    with caplog.at_level(logging.ERROR, logger="textgate.router.tenants"):
        assert not tenants.reload()
    assert "previous keys stay in force" in caplog.text and "not valid YAML" in caplog.text
    assert tenants.authenticate("new") is quota and tenants.authenticate("b") is not None
