"""bench.serving.kv_offload: its prompts, the server it starts and the table it prints."""

from __future__ import annotations

import pytest

from textgate.bench.serving import kv_offload
from textgate.bench.serving.kv_offload import (
    OffloadRound,
    build_parser,
    format_rounds,
    main,
    prefix_text,
    textgate_flags,
)


def test_prefixes_differ_from_the_first_word_and_have_the_length_asked() -> None:
    first, second = prefix_text(0, 200).split(), prefix_text(1, 200).split()
    assert len(first) == len(second) == 202  # "Record N:" and the words
    assert first[2:] != second[2:] and first[1] != second[1]
    assert prefix_text(0, 200) == prefix_text(0, 200)


def test_the_started_server_holds_about_one_prompt_on_the_device() -> None:
    args = build_parser().parse_args(["--device-tokens", "1000", "--textgate-args", "--port 1"])
    flags = textgate_flags(args)
    value = dict(zip(flags[::2], flags[1::2], strict=False))
    assert value["--kv-cache-memory"] == str(1000 * args.bytes_per_token)
    assert int(value["--kv-offload-bytes"]) > int(value["--kv-cache-memory"])
    assert value["--target-itl-ms"] == "0" and flags[-2:] == ["--port", "1"]


def test_the_table_shows_each_ratio_and_the_median() -> None:
    rounds = [OffloadRound(1000.0, 100.0, True, 1984), OffloadRound(1000.0, 300.0, True, 1984)]
    table = format_rounds(rounds)
    assert "0.100" in table and "0.300" in table
    assert "median host/recompute TTFT: 0.200x" in table


def test_a_restore_that_changed_the_text_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def rounds(url: str, args: object) -> list[OffloadRound]:
        return [OffloadRound(1000.0, 100.0, False, 1984)]

    monkeypatch.setattr(kv_offload, "run_rounds", rounds)
    assert main(["--url", "http://x"]) == 1
