"""The prompts a benchmark sends: synthetic prompts of a chosen token length, or chats.

- `synthetic`: each prompt is a slice of `input_len` tokens of ordinary English (the
  shipped conversation texts, tokenized with the served model's tokenizer), taken at a
  random offset so prompts differ and no two share a long prefix. With
  `input_len_range = r > 0` lengths are uniform in [input_len·(1-r), input_len·(1+r)].
- `conversations`: the ~50 short chats in `data/conversations.jsonl`, rendered with the
  model's chat template for the text routes and sent as messages to the chat route.
- `copying`: 16 chats in `data/copying.jsonl` that give a text and ask for it back,
  repeated or lightly edited (a typo fixed, a name changed, a docstring added): the answer
  copies its prompt, the workload n-gram speculation (`--speculate`) is for. Sent as
  `conversations` are.

`build_requests(spec, tokenizer, n, stream)` is reproducible: the same seed and `stream`
give the same prompts, so two servers (or the naive baseline) see identical work.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from textgate.bench.serving.tokenizer import BenchTokenizer

# Package data: read relative to this file so it works from a source checkout and a wheel.
CONVERSATIONS_PATH = Path(__file__).parents[1] / "data" / "conversations.jsonl"
COPYING_PATH = Path(__file__).parents[1] / "data" / "copying.jsonl"
CHAT_DATASETS = {"conversations": CONVERSATIONS_PATH, "copying": COPYING_PATH}
"""The datasets of whole chats, and their files."""
DATASETS = ("synthetic", *CHAT_DATASETS)


@dataclass(frozen=True)
class BenchRequest:
    """One prompt to send: text for the text routes, messages for the chat route."""

    prompt: str
    prompt_len: int
    messages: list[dict[str, str]] | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    """Which prompts to send."""

    dataset: str = "synthetic"
    input_len: int = 128
    input_len_range: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if self.input_len < 1:
            raise ValueError(f"input_len must be >= 1, got {self.input_len}")
        if not 0.0 <= self.input_len_range < 1.0:
            raise ValueError(f"input_len_range must be in [0, 1), got {self.input_len_range}")


def load_conversations(path: Path = CONVERSATIONS_PATH) -> list[list[dict[str, str]]]:
    """The chats in a JSONL file of `{"messages": [{"role", "content"}, ...]}` lines."""
    with path.open(encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line in f if line.strip()]


def build_requests(
    spec: WorkloadSpec, tokenizer: BenchTokenizer, num_requests: int, stream: int = 0
) -> list[BenchRequest]:
    """`num_requests` prompts; `stream` selects one of many reproducible prompt sets."""
    rng = random.Random(f"{spec.seed}:{stream}")
    if spec.dataset in CHAT_DATASETS:
        chats = load_conversations(CHAT_DATASETS[spec.dataset])
        return _conversation_requests(chats, tokenizer, num_requests, rng)
    return _synthetic_requests(spec, tokenizer, num_requests, rng)


def _conversation_requests(
    chats: list[list[dict[str, str]]],
    tokenizer: BenchTokenizer,
    num_requests: int,
    rng: random.Random,
) -> list[BenchRequest]:
    start = rng.randrange(len(chats))
    requests = []
    for i in range(num_requests):
        messages = chats[(start + i) % len(chats)]
        prompt = tokenizer.render_chat(messages)
        requests.append(BenchRequest(prompt, tokenizer.count(prompt), messages))
    return requests


def _synthetic_requests(
    spec: WorkloadSpec, tokenizer: BenchTokenizer, num_requests: int, rng: random.Random
) -> list[BenchRequest]:
    text = "\n".join(m["content"] for chat in load_conversations() for m in chat)
    source = tokenizer.encode(text)
    low = max(1, math.floor(spec.input_len * (1 - spec.input_len_range)))
    high = max(low, math.ceil(spec.input_len * (1 + spec.input_len_range)))
    requests = []
    for _ in range(num_requests):
        length = rng.randint(low, high)
        offset = rng.randrange(len(source))
        repeats = (offset + length) // len(source) + 1
        ids = (source * repeats)[offset : offset + length]
        prompt = _fit(tokenizer, tokenizer.decode(ids), length)
        requests.append(BenchRequest(prompt, tokenizer.count(prompt)))
    return requests


def _fit(tokenizer: BenchTokenizer, text: str, length: int) -> str:
    """Trim `text` until it re-tokenizes to at most `length` tokens.

    Decoding a token slice and encoding it again can merge or split tokens at the edges;
    a few trims converge for every tokenizer we use.
    """
    for _ in range(4):
        ids = tokenizer.encode(text)
        if len(ids) <= length:
            break
        text = tokenizer.decode(ids[:length])
    return text


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Add the workload options shared by the benchmark, the naive baseline and the sweep."""
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset", choices=DATASETS, default="synthetic")
    group.add_argument(
        "--input-len", type=int, default=128, help="prompt length in tokens (synthetic)"
    )
    group.add_argument(
        "--input-len-range",
        type=float,
        default=0.0,
        help="r in [0,1): prompt lengths uniform in input_len·[1-r, 1+r] (0 = fixed length)",
    )
    group.add_argument("--output-len", type=int, default=64, help="tokens to generate")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--tokenizer", default=None, help="tokenizer folder (default: the embedded model's)"
    )


def spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    """The WorkloadSpec the options of `add_workload_args` describe."""
    return WorkloadSpec(
        dataset=args.dataset,
        input_len=args.input_len,
        input_len_range=args.input_len_range,
        seed=args.seed,
    )
