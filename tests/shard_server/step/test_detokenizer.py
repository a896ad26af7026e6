from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from textgate.shard_server.step.detokenizer import IncrementalDetokenizer


def test_deltas_rebuild_the_text_including_multibyte(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tokenizer("Say:").input_ids
    generated = tokenizer(" café naïve 東京 🙂 Paris is the capital").input_ids
    detok = IncrementalDetokenizer.for_prompt(len(prompt))
    ids = list(prompt)
    deltas = []
    for token in generated:
        ids.append(token)
        deltas.append(detok.step(tokenizer, ids))
    assert "".join(deltas) == tokenizer.decode(generated)
    assert all("\ufffd" not in d for d in deltas)
    # Byte-level tokens split multi-byte characters: some steps must have emitted nothing.
    assert "" in deltas
