"""The committed gRPC stubs must be exactly what codegen produces from generate.proto."""

from __future__ import annotations

import re
from itertools import pairwise
from pathlib import Path

from textgate.proto import codegen
from textgate.proto import generate_pb2 as pb

_FIELD = re.compile(r"^\s*(?:optional |repeated )?[\w.<>, ]+ (\w+) = \d+;")
_RPC = re.compile(r"^\s*rpc (\w+)\(")


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    codegen.generate(tmp_path)
    for name in codegen.STUB_NAMES:
        committed = (codegen.PROTO_DIR / name).read_text()
        assert (tmp_path / name).read_text() == committed, (
            f"proto/{name} is stale: run `make stubs` and commit the result"
        )


def test_every_rpc_and_message_field_is_documented() -> None:
    """A comment sits on the line above every rpc and every message field."""
    lines = (codegen.PROTO_DIR / "generate.proto").read_text().splitlines()
    undocumented = []
    for above, line in pairwise(lines):
        match = _FIELD.match(line) or _RPC.match(line)
        if match and not above.strip().startswith("//"):
            undocumented.append(match.group(1))
    assert not undocumented, f"fields without a comment: {undocumented}"


def test_the_contract_has_one_step_protocol() -> None:
    service = pb.DESCRIPTOR.services_by_name["TextGenerationService"]
    assert set(service.methods_by_name) == {
        "Info",
        "Health",
        "ServiceDiscovery",
        "ClearCache",
        "Warmup",
        "Step",
        "LoadAdapter",
        "UnloadAdapter",
    }
    # The padded protocol's messages are gone; their numbers stay reserved where they were.
    assert not {"Batch", "CachedBatch", "PrefillRequest"} & set(pb.DESCRIPTOR.message_types_by_name)
    assert not pb.ClearCacheRequest.DESCRIPTOR.fields
    assert "batch" not in pb.WarmupRequest.DESCRIPTOR.fields_by_name
    assert [f.name for f in pb.StepRequest.DESCRIPTOR.fields] == ["requests", "plan"]
