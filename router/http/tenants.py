"""API keys and their tenants: the key file (`--api-keys-file`), its loading and reloading,
and the constant-time lookup of the key a request presents.

Only sha256 digests of keys are kept: a file may give them (`key_sha256`), and plaintext
keys are hashed as the file is read. `--api-key` beside a file is one more key, of the
tenant "default" (with the limits the file gives that tenant, if it names it).
docs/tenancy.md has the format.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator
from pydantic import ValidationError as PydanticValidationError

from textgate.router.config import RouterConfig
from textgate.router.engine.quota import Limits, TenantQuota
from textgate.router.engine.rate_window import Clock

log = logging.getLogger("textgate.router.tenants")

DEFAULT_TENANT = "default"
"""The tenant of `--api-key` when a key file is given too."""

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


class KeyEntry(BaseModel):
    """One key of the file: the key (or its sha256), its tenant and the tenant's limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str | None = Field(None, min_length=1)
    key_sha256: str | None = None
    """The hex sha256 digest of the key, so the file need not hold the key itself."""
    tenant: str = Field(min_length=1)
    requests_per_minute: PositiveInt | None = None
    tokens_per_minute: PositiveInt | None = None
    max_concurrent: PositiveInt | None = None
    max_new_tokens: PositiveInt | None = None
    priority: int | None = None
    weight: PositiveFloat = 1.0
    timeout_s: PositiveFloat | None = None
    models: list[str] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_key(self) -> KeyEntry:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError("give exactly one of `key` and `key_sha256`")
        if self.key_sha256 is not None and not _SHA256_HEX.match(self.key_sha256.lower()):
            raise ValueError("`key_sha256` must be 64 hex digits (a sha256 digest)")
        return self

    def digest(self) -> bytes:
        """The sha256 digest of the key."""
        if self.key is not None:
            return hash_key(self.key)
        assert self.key_sha256 is not None
        return bytes.fromhex(self.key_sha256)

    def limits(self) -> Limits:
        return Limits(
            requests_per_minute=self.requests_per_minute,
            tokens_per_minute=self.tokens_per_minute,
            max_concurrent=self.max_concurrent,
            max_new_tokens=self.max_new_tokens,
            priority=self.priority,
            weight=self.weight,
            timeout_s=self.timeout_s,
            models=None if self.models is None else frozenset(self.models),
        )


class KeysFile(BaseModel):
    """The key file: `keys`, a list of `KeyEntry`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: list[KeyEntry] = Field(min_length=1)


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class KeyTable:
    """Key digests and the tenant of each; each tenant's limits."""

    digests: tuple[tuple[bytes, str], ...]
    limits: Mapping[str, Limits]

    def tenant_of(self, key: str) -> str | None:
        """The tenant whose key `key` is, or None. Every digest is compared, each in
        constant time, so the time taken says nothing about the keys."""
        given = hash_key(key)
        found = None
        for digest, tenant in self.digests:
            if hmac.compare_digest(digest, given):
                found = tenant
        return found


def parse_keys_file(text: str, source: str) -> KeyTable:
    """The key table in `text` (YAML, or JSON when `source` ends in .json); ValueError
    naming `source` and the entry at fault."""
    try:
        data = json.loads(text) if source.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"{source}: not valid {_format(source)}: {exc}") from exc
    try:
        parsed = KeysFile.model_validate(data)
    except PydanticValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'file'}: {e['msg']}" for e in exc.errors()
        )
        raise ValueError(f"{source}: {problems}") from None
    return _table(parsed.keys, source)


def load_keys_file(path: str) -> KeyTable:
    """`parse_keys_file` of the file at `path`."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read the API keys file {path}: {exc}") from exc
    return parse_keys_file(text, path)


def _format(source: str) -> str:
    return "JSON" if source.endswith(".json") else "YAML"


def _table(entries: list[KeyEntry], source: str) -> KeyTable:
    digests: dict[bytes, str] = {}
    limits: dict[str, Limits] = {}
    for i, entry in enumerate(entries):
        digest = entry.digest()
        if digest in digests:
            raise ValueError(f"{source}: keys.{i}: the same key is listed twice")
        digests[digest] = entry.tenant
        known = limits.setdefault(entry.tenant, entry.limits())
        if known != entry.limits():
            raise ValueError(
                f"{source}: keys.{i}: tenant `{entry.tenant}` is given other limits than by "
                "its earlier key; its keys share one quota, so give them the same limits"
            )
    return KeyTable(tuple(digests.items()), limits)


def with_api_key(table: KeyTable | None, api_key: str | None) -> KeyTable | None:
    """`table` with `--api-key` as a key of the tenant "default" (alone: the only key)."""
    if api_key is None:
        return table
    base = table or KeyTable((), {})
    digest = hash_key(api_key)
    digests = tuple((d, t) for d, t in base.digests if d != digest)
    limits = {DEFAULT_TENANT: Limits(), **base.limits}
    return KeyTable((*digests, (digest, DEFAULT_TENANT)), limits)


class Tenants:
    """The key table in force and every tenant's quota; `reload` re-reads the key file
    (on SIGHUP) and keeps each tenant's usage, and its requests in flight, across it."""

    def __init__(
        self,
        table: KeyTable,
        *,
        path: str | None = None,
        api_key: str | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.path = path
        self._api_key = api_key
        self._clock = clock
        self._table = table
        self._quotas: dict[str, TenantQuota] = {}
        self._apply(table)

    @classmethod
    def from_config(cls, config: RouterConfig, clock: Clock = time.monotonic) -> Tenants | None:
        """The tenants of `--api-keys-file` and `--api-key`; None when neither is set (every
        route is open). ValueError for a bad key file."""
        path = config.api_keys_file
        table = with_api_key(load_keys_file(path) if path else None, config.api_key)
        if table is None:
            return None
        return cls(table, path=path, api_key=config.api_key, clock=clock)

    @property
    def names(self) -> tuple[str, ...]:
        """The tenants, sorted."""
        return tuple(sorted(self._quotas))

    def authenticate(self, key: str | None) -> TenantQuota | None:
        """The quota of the tenant whose key `key` is; None for a missing or unknown key."""
        if not key:
            return None
        tenant = self._table.tenant_of(key)
        return None if tenant is None else self._quotas[tenant]

    def reload(self) -> bool:
        """Re-read the key file; a bad one is logged and the keys in force are kept."""
        if self.path is None:
            return False
        try:
            table = with_api_key(load_keys_file(self.path), self._api_key)
        except ValueError as exc:
            log.error("API keys not reloaded, the previous keys stay in force: %s", exc)
            return False
        assert table is not None
        self._apply(table)
        log.info(
            "API keys reloaded from %s: %d keys of %d tenants",
            self.path,
            len(table.digests),
            len(table.limits),
        )
        return True

    def _apply(self, table: KeyTable) -> None:
        quotas = {}
        for name, limits in table.limits.items():
            quota = self._quotas.get(name)
            if quota is None:
                quota = TenantQuota(name, limits, self._clock)
            else:
                quota.update(limits)
            quotas[name] = quota
        # Swapped whole: a lookup sees the old table or the new one, never half of each.
        self._table, self._quotas = table, quotas
