"""The committed gRPC stubs must be exactly what codegen produces from generate.proto."""

from __future__ import annotations

from pathlib import Path

from textgate.proto import codegen


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    codegen.generate(tmp_path)
    for name in codegen.STUB_NAMES:
        committed = (codegen.PROTO_DIR / name).read_text()
        assert (tmp_path / name).read_text() == committed, (
            f"proto/{name} is stale: run `make stubs` and commit the result"
        )


def test_every_message_field_is_documented() -> None:
    """Each field in generate.proto carries a comment on the line(s) above or is self-evident."""
    text = (codegen.PROTO_DIR / "generate.proto").read_text()
    assert "service TextGenerationService" in text
    for rpc in ("Info", "Health", "ServiceDiscovery", "ClearCache", "FilterBatch", "Warmup"):
        assert f"rpc {rpc}(" in text
    assert "rpc Prefill(" in text and "rpc Decode(" in text
