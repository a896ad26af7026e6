"""Answer texts cut before the stop sequence that ended them, whole and as they stream."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from textgate.router.engine.channel import Finished, TokenInfo
from textgate.router.generation.stop_text import StreamText, TextOptions, answer_text, trim_stop


def tok(text: str, special: bool = False) -> TokenInfo:
    return TokenInfo(id=7, text=text, logprob=-0.5, special=special)


def test_trim_stop_cuts_at_the_first_match() -> None:
    assert trim_stop("a b STOP c", ["STOP"]) == "a b "
    assert trim_stop("xAByCD", ["CD", "AB"]) == "x"
    assert trim_stop("abc", ["z"]) == "abc"


def test_answer_text_cuts_only_after_a_stop_sequence() -> None:
    options = TextOptions(stop=("b",))
    assert answer_text(Finished("abc", 3, "stop_sequence", None), options) == "a"
    assert answer_text(Finished("abc", 3, "length", None), options) == "abc"
    keep = TextOptions(stop=("b",), keep_stop=True)
    assert answer_text(Finished("ab", 2, "stop_sequence", None), keep) == "ab"


def test_stream_text_never_sends_part_of_the_matched_stop() -> None:
    stream = StreamText(TextOptions(stop=("STOP",)))
    sent = [stream.push([tok(t)]) for t in ("Hello ", "S", "T")]
    sent.append(stream.push([tok("OP!")], "stop_sequence"))
    assert "".join(sent) == "Hello "
    assert all("S" not in s for s in sent)


def test_stream_text_releases_held_text_that_was_no_stop() -> None:
    stream = StreamText(TextOptions(stop=("STOP",)))
    sent = [stream.push([tok(t)]) for t in ("ab", "ST", "x", "yz")]
    sent.append(stream.push([tok("!")], "length"))
    assert "".join(sent) == "abSTxyz!"


def test_stream_text_skips_special_tokens() -> None:
    stream = StreamText(TextOptions())
    assert stream.push([tok("hi")]) == "hi"
    assert stream.push([tok("</s>", special=True)], "eos_token") == ""


@given(
    pieces=st.lists(st.text(alphabet="abS", min_size=0, max_size=3), min_size=1, max_size=12),
    stop=st.text(alphabet="abS", min_size=1, max_size=3),
)
def test_stream_text_equals_the_trimmed_whole(pieces: list[str], stop: str) -> None:
    """Whatever the split, the streamed text is the finished text cut before the stop."""
    text = ""
    stream = StreamText(TextOptions(stop=(stop,)))
    sent = ""
    for i, piece in enumerate(pieces):
        text += piece
        # The shard ends the request at the first token whose text completes a stop.
        if stop in text or i == len(pieces) - 1:
            reason = "stop_sequence" if stop in text else "length"
            sent += stream.push([tok(piece)], reason)  # type: ignore[arg-type]
            assert sent == (trim_stop(text, [stop]) if stop in text else text)
            return
        sent += stream.push([tok(piece)])
        assert stop not in sent
