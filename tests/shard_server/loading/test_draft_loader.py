"""The draft model's loader: a draft must share the served model's tokens (its tokenizer,
where its folder has one, and a vocabulary that embeds every token of the served tokenizer
without exceeding the served model's); what loads is a proposer over the target's blocks,
limited to the positions both models have."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from textgate.shard_server.loading.draft_loader import check_vocabulary, load_draft
from textgate.shard_server.loading.shard_loader import load_tokenizer
from textgate.shard_server.models import load_model
from textgate.tests.conftest import build_tiny_model


@pytest.fixture(scope="module")
def target(tiny_model_dir: Path) -> object:
    return load_model(tiny_model_dir, torch.float32, "cpu")


def test_a_draft_with_another_tokenizer_is_refused(
    tiny_model_dir: Path, default_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match="tokenizer differs"):
        check_vocabulary(tiny_model_dir, AutoTokenizer.from_pretrained(default_model_dir))


@pytest.mark.parametrize(("vocab_size", "message"), [(200, "cannot embed"), (400, "larger")])
def test_a_draft_vocabulary_that_does_not_fit_is_refused(
    tiny_model_dir: Path,
    target: object,
    tmp_path: Path,
    vocab_size: int,
    message: str,
) -> None:
    draft = build_tiny_model(tmp_path / "draft", vocab_size=vocab_size)
    tokenizer = load_tokenizer(tiny_model_dir).tokenizer
    with pytest.raises(ValueError, match=message):
        load_draft(draft, None, target, tokenizer, block_size=4)


def test_a_draft_loads_with_the_positions_both_models_have(
    tiny_model_dir: Path, target: object, tmp_path: Path
) -> None:
    draft = build_tiny_model(tmp_path / "short", seed=1, max_position_embeddings=64)
    tokenizer = load_tokenizer(tiny_model_dir).tokenizer
    proposer = load_draft(draft, "int8", target, tokenizer, block_size=4)
    assert proposer.max_positions == 64 and proposer.model.quantize == "int8"
    assert proposer.bytes_per_block() > 0
