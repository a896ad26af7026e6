"""NgramIndex: the longest suffix found earlier proposes what followed its latest occurrence."""

from __future__ import annotations

import pytest

from textgate.router.engine.ngram_proposer import NgramIndex


def test_the_longest_matching_suffix_proposes_its_continuation() -> None:
    tokens = [1, 2, 3, 4, 5, 9, 9, 2, 3]
    index = NgramIndex(1, 3)
    # "2 3" occurred at 1..2: "4 5 9" followed it.
    assert index.propose(tokens, 3) == (4, 5, 9)
    assert index.propose(tokens, 1) == (4,)


def test_the_latest_earlier_occurrence_wins_and_longer_beats_shorter() -> None:
    tokens = [7, 1, 5, 0, 7, 1, 6, 8, 3, 7, 1]
    # "7 1" occurred twice before the end; the latest (at 4) continues with 6 8.
    assert NgramIndex(1, 3).propose(tokens, 2) == (6, 8)
    # "3 7 1" is nowhere earlier, "7 1" is: min_n 3 finds nothing.
    assert NgramIndex(3, 3).propose(tokens, 2) == ()


def test_no_earlier_occurrence_proposes_nothing_and_the_suffix_is_not_its_own_match() -> None:
    assert NgramIndex(1, 3).propose([1, 2, 3, 4], 4) == ()
    assert NgramIndex(1, 3).propose([5], 4) == ()
    # A run of one token: the continuation is the run itself, never past the sequence.
    assert NgramIndex(1, 3).propose([4, 4, 4], 5) == (4,)


def test_the_index_grows_with_the_sequence() -> None:
    index = NgramIndex(2, 2)
    tokens = [1, 2, 3]
    assert index.propose(tokens, 2) == ()
    tokens += [1, 2]
    assert index.propose(tokens, 2) == (3, 1)
    tokens += [9, 2, 3]
    assert index.propose(tokens, 2) == (1, 2)


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramIndex(3, 2)
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramIndex(0, 2)
