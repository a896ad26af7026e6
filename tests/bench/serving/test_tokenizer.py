from __future__ import annotations

from types import SimpleNamespace

from textgate.bench.serving import tokenizer as bench_tokenizer
from textgate.bench.serving.tokenizer import BenchTokenizer, load_tokenizer


def test_load_from_a_folder(tiny_tokenizer_dir) -> None:
    tok = load_tokenizer(tiny_tokenizer_dir)
    ids = tok.encode("What is the capital")
    assert len(ids) == 4 == tok.count("What is the capital")
    assert tok.decode(ids) == "What is the capital"
    assert tok.render_chat([{"role": "user", "content": "Hi"}]) == "user : Hi assistant :"
    assert tok.source == str(tiny_tokenizer_dir)


def test_default_is_the_embedded_models_tokenizer(tiny_tokenizer_dir, monkeypatch) -> None:
    monkeypatch.setattr(bench_tokenizer, "default_model_dir", lambda: tiny_tokenizer_dir)
    assert load_tokenizer().source == str(tiny_tokenizer_dir)


def test_render_chat_without_a_template() -> None:
    tok = BenchTokenizer(SimpleNamespace(chat_template=None), source="x")
    assert tok.render_chat([{"role": "user", "content": "Hi"}]) == "user: Hi\nassistant:"
