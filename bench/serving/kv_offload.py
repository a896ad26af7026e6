"""`python -m textgate.bench.serving.kv_offload`: a long prefix back from the host KV tier.

Issue 30's claim: a shared prefix evicted from the device KV cache to the host tier
(`--kv-offload-bytes`) comes back faster than recomputing it. Each round, on one server
whose device cache holds about one long prompt:

1. **recompute**: a prompt with a fresh `--prefix-tokens`-token prefix (nothing cached):
   its TTFT is the cost of computing the prefix;
2. **evict**: a longer prompt with another prefix, which takes every device block;
3. **host**: the first prompt again: its prefix is restored from the host tier.

Prints each round's TTFTs and the host / recompute ratio (issue 30's goal: at most 0.3x),
their median, and whether the greedy text of step 3 equals step 1's. Without `--url` it
starts textgate (`textgate-launcher`) with a device cache of `--device-tokens` tokens, a
host tier, fixed step budgets (a whole prompt per step, so the TTFT is the prefill's and
not the batch controller's chunking) and float32, plus `--textgate-args`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from textgate.bench.serving.sweep import launcher_command, running_server

# float32 SmolLM2-135M (the embedded default): 2 x 30 layers x 3 kv heads x 64 x 4 bytes.
DEFAULT_BYTES_PER_TOKEN = 46_080


@dataclass(frozen=True)
class OffloadRound:
    """One round's TTFTs (milliseconds) and whether the restored prompt's text matched."""

    recompute_ttft_ms: float
    host_ttft_ms: float
    same_text: bool
    host_hit_tokens: float

    @property
    def ratio(self) -> float:
        """Host-tier TTFT ÷ recompute TTFT (the goal: at most 0.3)."""
        return self.host_ttft_ms / self.recompute_ttft_ms


WORDS = [
    "time",
    "year",
    "people",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "government",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
]
"""Common English words, one token each (with their leading space) in SmolLM2's tokenizer."""


def prefix_text(seed: int, num_words: int) -> str:
    """About `num_words` tokens that differ from every other seed's from the first one on."""
    words = (WORDS[(i * 7 + seed * 13 + i // len(WORDS)) % len(WORDS)] for i in range(num_words))
    return f"Record {seed}: " + " ".join(words)


def stream_ttft(
    client: httpx.Client, url: str, prompt: str, max_new_tokens: int
) -> tuple[float, str]:
    """(seconds to the first token event, the whole greedy text) of one /generate_stream."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "do_sample": False}}
    start = time.perf_counter()
    ttft: float | None = None
    text = ""
    with client.stream("POST", f"{url}/generate_stream", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line.removeprefix("data:"))
            if "error" in event:
                raise RuntimeError(f"the server failed the request: {event['error']}")
            if ttft is None:
                ttft = time.perf_counter() - start
            text += event["token"]["text"]
    if ttft is None:
        raise RuntimeError("the stream ended without a token")
    return ttft, text


def host_hit_tokens(client: httpx.Client, url: str) -> float:
    """The server's count of prompt tokens restored from the host tier so far."""
    for line in client.get(f"{url}/metrics").text.splitlines():
        if line.startswith('textgate_prefix_cache_tier_hit_tokens{tier="host"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def run_rounds(url: str, args: argparse.Namespace) -> list[OffloadRound]:
    """Every round against `url` (a fresh prefix per round)."""
    words = args.prefix_tokens
    rounds = []
    with httpx.Client(timeout=args.timeout) as client:
        stream_ttft(client, url, prefix_text(10_000, 50), args.output_len)  # warm the path
        for index in range(args.rounds):
            prompt = prefix_text(2 * index, words)
            recompute, text = stream_ttft(client, url, prompt, args.output_len)
            stream_ttft(client, url, prefix_text(2 * index + 1, int(words * 1.12)), 1)
            hits_before = host_hit_tokens(client, url)
            host, restored_text = stream_ttft(client, url, prompt, args.output_len)
            rounds.append(
                OffloadRound(
                    recompute_ttft_ms=recompute * 1e3,
                    host_ttft_ms=host * 1e3,
                    same_text=restored_text == text,
                    host_hit_tokens=host_hit_tokens(client, url) - hits_before,
                )
            )
            print(f"[round {index + 1}] {rounds[-1]}", file=sys.stderr, flush=True)
    return rounds


def textgate_flags(args: argparse.Namespace) -> list[str]:
    """A device cache of about one long prompt, a host tier for several, fixed budgets."""
    per_token = args.bytes_per_token
    return [
        "--dtype", "float32",
        "--kv-cache-memory", str(args.device_tokens * per_token),
        "--kv-offload-bytes", str(8 * args.device_tokens * per_token),
        "--max-input-tokens", str(args.device_tokens - args.output_len - 16),
        "--max-total-tokens", str(args.device_tokens),
        "--max-batch-prefill-tokens", str(args.device_tokens),
        "--target-itl-ms", "0",
        *shlex.split(args.textgate_args),
    ]  # fmt: skip


def format_rounds(rounds: Sequence[OffloadRound]) -> str:
    lines = [
        "round  recompute TTFT ms  host-tier TTFT ms  host/recompute  host hit tokens  same text"
    ]
    for i, r in enumerate(rounds):
        lines.append(
            f"{i + 1:>5}  {r.recompute_ttft_ms:>17.1f}  {r.host_ttft_ms:>17.1f}  "
            f"{r.ratio:>14.3f}  {r.host_hit_tokens:>15.0f}  {r.same_text}"
        )
    median = statistics.median(r.ratio for r in rounds)
    lines.append(f"median host/recompute TTFT: {median:.3f}x (goal <= 0.3x)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m textgate.bench.serving.kv_offload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", default=None, help="a running server (else textgate starts)")
    parser.add_argument("--textgate-args", default="", help="extra textgate-launcher flags")
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--device-tokens", type=int, default=2304, help="device KV cache, tokens")
    parser.add_argument("--bytes-per-token", type=int, default=DEFAULT_BYTES_PER_TOKEN)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the rounds; 1 when a restored prompt's text differed or nothing was restored."""
    args = build_parser().parse_args(argv)
    if args.url is not None:
        rounds = run_rounds(args.url, args)
    else:
        with running_server(launcher_command(textgate_flags(args))) as url:
            rounds = run_rounds(url, args)
    print(f"{args.prefix_tokens}-token prefix, {args.output_len} output tokens, greedy")
    print(format_rounds(rounds))
    return 0 if all(r.same_text and r.host_hit_tokens > 0 for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
