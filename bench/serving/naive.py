"""`python -m textgate.bench.serving.naive`: the baseline every serving article starts from.

transformers' `AutoModelForCausalLM.generate`, one request at a time, greedy, exactly
`output_len` new tokens (`min_new_tokens = max_new_tokens`), on the same prompts the
server benchmark sends. A streamer timestamps every generated token, so TTFT, TPOT, ITL
and E2E mean the same as for a server (minus HTTP), and the same tables are printed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.streamers import BaseStreamer

from textgate.bench.serving.metrics import RequestOutcome, compute_metrics
from textgate.bench.serving.report import append_json_lines, format_metrics, metrics_record
from textgate.bench.serving.runner import Log, log_stderr
from textgate.bench.serving.tokenizer import BenchTokenizer, default_model_dir, load_tokenizer
from textgate.bench.serving.workload import (
    BenchRequest,
    add_workload_args,
    build_requests,
    spec_from_args,
)


class TokenTimer(BaseStreamer):
    """Records the time each generated token reaches the streamer."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        # generate() first puts the prompt ids, then one tensor per generated token.
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        """Nothing to flush: times are recorded as tokens arrive."""


def load_model(model_dir: str | Path, dtype: str = "float32", device: str = "cpu") -> Any:
    """The model in `model_dir`, in eval mode, with weights in `dtype` on `device`."""
    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    return model.to(device).eval()


def generate_timed(
    model: Any, tokenizer: BenchTokenizer, request: BenchRequest, output_len: int
) -> RequestOutcome:
    """Generate exactly `output_len` greedy tokens for one prompt, timing every token."""
    ids = torch.tensor([tokenizer.model_input_ids(request.prompt)], device=model.device)
    eos = model.generation_config.eos_token_id
    config = GenerationConfig(
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=model.generation_config.pad_token_id or eos,
    )
    timer = TokenTimer()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=timer
        )
    times = timer.times
    return RequestOutcome(
        success=bool(times),
        prompt_len=ids.shape[1],
        output_tokens=len(times),
        ttft=times[0] - start if times else 0.0,
        itl=[b - a for a, b in pairwise(times)],
        latency=times[-1] - start if times else 0.0,
        start_time=start,
        error="" if times else "no token generated",
    )


def run_naive(
    model: Any,
    tokenizer: BenchTokenizer,
    requests: Sequence[BenchRequest],
    output_len: int,
    warmup: int = 1,
    log: Log = log_stderr,
) -> tuple[list[RequestOutcome], float]:
    """Run `requests` one after another (after `warmup` unmeasured ones taken from them)."""
    for request in list(requests)[:warmup]:
        generate_timed(model, tokenizer, request, output_len)
    outcomes = []
    start = time.perf_counter()
    for i, request in enumerate(requests):
        outcomes.append(generate_timed(model, tokenizer, request, output_len))
        log(f"[naive] request {i + 1}/{len(requests)}: {outcomes[-1].latency:.2f}s")
    return outcomes, time.perf_counter() - start


def build_parser() -> argparse.ArgumentParser:
    """The command line of the naive baseline."""
    parser = argparse.ArgumentParser(
        prog="python -m textgate.bench.serving.naive", description=__doc__
    )
    parser.add_argument("--model", default=None, help="model folder (default: embedded model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, …")
    parser.add_argument("--json-out", default=None, help="append one JSON line")
    add_workload_args(parser)
    parser.set_defaults(input_len=40)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the naive baseline and print the same tables as `textgate-bench`."""
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else default_model_dir()
    tokenizer = load_tokenizer(args.tokenizer or model_dir)
    requests = build_requests(spec_from_args(args), tokenizer, args.num_requests)
    model = load_model(model_dir, args.dtype, args.device)
    outcomes, duration = run_naive(model, tokenizer, requests, args.output_len, args.warmup)
    metrics = compute_metrics(outcomes, duration)
    print(
        f"naive: transformers generate, {model_dir}, {args.dtype}, {torch.get_num_threads()} threads"
    )
    print(format_metrics([("naive", metrics)]))
    if args.json_out:
        context = {
            "target": "naive",
            "model": str(model_dir),
            "dtype": args.dtype,
            "device": args.device,
            "threads": torch.get_num_threads(),
            "dataset": args.dataset,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "concurrency": 1,
            "num_requests": len(outcomes),
        }
        append_json_lines(args.json_out, [metrics_record(metrics, context)])
    return 0 if metrics.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
