"""`python -m textgate.bench.micro.step`: the shard's own step time, without HTTP or the router.

Loads a model the way a shard does (native, paged; `--dtype auto` as the launcher's
default), then for each batch size B: one prefill step of B prompts of `--prompt-len`
tokens, then `--steps` decode steps of all B. Prints the prefill step's time and the
decode steps' median, the way `textgate-bench` numbers decompose: what the model costs
per step, before serving adds its share. `--quantize` times a quantized model (int8,
bitsandbytes, ...); `--transformers` the same checkpoint through transformers-on-paged
(`shard_server.models.transformers_paged`, the shard's `--no-native`), for the ratio to
its native class. `TEXTGATE_CPU_KERNELS=0` runs the PyTorch references instead of the C
kernels, for an A/B of the same code.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from textgate.bench.serving.cli import parse_list
from textgate.bench.serving.report import format_table
from textgate.bench.serving.tokenizer import default_model_dir
from textgate.kernels import int4_linear
from textgate.proto import generate_pb2 as pb
from textgate.shard_server.loading.shard_loader import (
    load_model,
)
from textgate.shard_server.protocols.paged_model import CacheConfig, PagedModel
from textgate.shard_server.startup.step_timing import probe_request

BLOCK_SIZE = 16


def time_batch(
    model: PagedModel,
    batch: int,
    prompt_len: int,
    steps: int,
    first_id: int,
    adapters: Sequence[str] = (),
) -> tuple[float, list[float]]:
    """Seconds of the prefill step of `batch` prompts, and of each decode step after it;
    with `adapters`, the requests take them in turn (LoRA ids the model has loaded)."""
    blocks = (prompt_len + steps + BLOCK_SIZE) // BLOCK_SIZE + 1
    tokens = {first_id + i: [100 + (i + j) % 1000 for j in range(prompt_len)] for i in range(batch)}
    tables = {rid: list(range(i * blocks, (i + 1) * blocks)) for i, rid in enumerate(tokens)}

    def run(new: list[pb.Request], prompt: bool) -> float:
        plan = pb.StepPlan(
            scheduled=[
                pb.ScheduledRequest(
                    request_id=rid,
                    token_ids=seq if prompt else seq[-1:],
                    start_position=0 if prompt else len(seq) - 1,
                    block_table=tables[rid],
                    produces_token=True,
                )
                for rid, seq in tokens.items()
            ]
        )
        start = time.perf_counter()
        response = model.step(new, plan)
        seconds = time.perf_counter() - start
        for generation in response.generations:
            tokens[generation.request_id].append(generation.tokens.ids[0])
        return seconds

    requests = [probe_request(rid, seq, steps + 2) for rid, seq in tokens.items()]
    for i, request in enumerate(requests):
        request.adapter_id = adapters[i % len(adapters)] if adapters else ""
    prefill = run(requests, prompt=True)
    decodes = [run([], prompt=False) for _ in range(steps)]
    model.step([], pb.StepPlan(finished_ids=list(tokens)))
    return prefill, decodes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m textgate.bench.micro.step", description=__doc__
    )
    parser.add_argument("--model", default=None, help="model folder (default: the embedded one)")
    parser.add_argument("--dtype", default="auto", help="as the launcher's --dtype")
    parser.add_argument(
        "--quantize", default=None, help="as the launcher's --quantize (e.g. int8, bitsandbytes)"
    )
    parser.add_argument("--batch", default="1,32", help="batch sizes")
    parser.add_argument("--prompt-len", type=int, default=40)
    parser.add_argument("--steps", type=int, default=30, help="decode steps per batch size")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument(
        "--no-int4-expand",
        action="store_true",
        help="4-bit layers run every prompt chunk through the int4 kernel, not the bf16 "
        "expansion (int4_linear.PROMPT_ROWS): the A/B of that choice",
    )
    parser.add_argument(
        "--no-decoder-stack",
        action="store_true",
        help="decoder layers run module by module, not as one C call per step "
        "(kernels/cpu_decoder.py): the A/B of that path",
    )
    parser.add_argument(
        "--transformers",
        action="store_true",
        help="run the model's transformers modules on the paged engine even where a native "
        "class exists (the A/B of the two paths: the shard's --no-native)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.no_int4_expand:
        int4_linear.PROMPT_ROWS = sys.maxsize
    model_dir = Path(args.model) if args.model else default_model_dir()
    batches = parse_list(args.batch, int)
    blocks = (args.prompt_len + args.steps + BLOCK_SIZE) // BLOCK_SIZE + 1
    cache_bytes = 1 << 30
    cache_config = CacheConfig(BLOCK_SIZE, cache_bytes)
    model = load_model(
        model_dir,
        model_dir.name,
        args.dtype,
        cache_config=cache_config,
        native=not args.transformers,
        quantize=args.quantize,
    )
    if args.no_decoder_stack:
        model.model.use_decoder_stack = False
    warmup = model.warmup(pb.WarmupRequest(max_prefill_tokens=args.prompt_len))
    if warmup.num_blocks < max(batches) * blocks:
        print(f"a 1 GiB cache holds {warmup.num_blocks} blocks, too few", file=sys.stderr)
        return 1
    time_batch(model, 1, args.prompt_len, 2, first_id=0)  # first-call costs
    rows = []
    for index, batch in enumerate(batches):
        prefill, decodes = time_batch(
            model, batch, args.prompt_len, args.steps, first_id=(index + 1) * 10_000
        )
        median = statistics.median(decodes)
        rows.append(
            [batch, round(prefill * 1e3, 1), round(median * 1e3, 2), round(min(decodes) * 1e3, 2),
             round(batch / median, 1)]
        )  # fmt: skip
    print(
        f"{model_dir.name}: {model.model.dtype}, {getattr(model.model, 'quantize', None) or 'unquantized'}, "
        f"{torch.get_num_threads()} threads, "
        f"prompts of {args.prompt_len} tokens, {args.steps} decode steps; "
        f"{model.model.implementation}"
    )
    headers = ["batch", "prefill step ms", "decode step ms p50", "min", "decode tok/s"]
    print(format_table(headers, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
