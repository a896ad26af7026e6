"""The cache root: `$TEXTGATE_CACHE`, else `~/.cache/textgate`, read on each call."""

from __future__ import annotations

from pathlib import Path

from textgate.paths import cache_dir


def test_the_environment_names_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TEXTGATE_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path


def test_the_default_is_under_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("TEXTGATE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "textgate"


def test_an_empty_variable_means_the_default(monkeypatch, tmp_path):
    monkeypatch.setenv("TEXTGATE_CACHE", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == Path(tmp_path) / ".cache" / "textgate"
