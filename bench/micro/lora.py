"""`python -m textgate.bench.micro.lora`: what serving LoRA adapters costs a shard's step.

Makes `--adapters` random PEFT adapters (rank `--rank`, every attention and MLP
projection; random A and B) for the model (default: the embedded one), loads it the way
a shard does with them attached, then times, interleaved over `--rounds`, decode steps
of `--batch` sequences all on the base and the same batch spread evenly over the
adapters (`bench.micro.step.time_batch`). Prints each side's decode tok/s (best round),
their ratio, and the median of each round's ratio (a round times both sides back to back,
so a machine whose speed drifts between rounds moves both), the same for the batch's
prefill step, the milliseconds one adapter takes to load (its folder read into a host
copy and checked) and to be made resident (attached between two steps and its layers'
form its steps run folded: what a swap past `--max-loras` adds to the step after it). That
adapter is evicted again before the steps are timed, so exactly `--adapters` are resident.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from textgate.bench.micro.step import BLOCK_SIZE, time_batch
from textgate.bench.serving.tokenizer import default_model_dir
from textgate.proto import generate_pb2 as pb
from textgate.shard_server.layers.lora import BATCHED_DEVICES, LoraLayer
from textgate.shard_server.layers.lora_limits import LoraLimits
from textgate.shard_server.loading.shard_loader import load_model
from textgate.shard_server.protocols.paged_model import CacheConfig, PagedModel

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, out: Path, count: int, rank: int) -> list[tuple[str, str]]:
    """`count` random PEFT adapters of the model in `model_dir`, saved under `out`."""
    import peft
    from transformers import AutoModelForCausalLM

    adapters = []
    for index in range(count):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS)
        lora = peft.get_peft_model(model, config)
        generator = torch.Generator().manual_seed(index)
        with torch.no_grad():
            for name, parameter in lora.named_parameters():
                if "lora_" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.01)
        lora.save_pretrained(out / f"lora{index}")
        adapters.append((f"lora{index}", str(out / f"lora{index}")))
    return adapters


def fold(model: torch.nn.Module) -> None:
    """Fold every LoRA layer's form for this device's steps now, as the first step after a
    change does (the CPU's stacked pairs, else the dense form; in inference mode, as a step
    runs)."""
    device = next(model.parameters()).device.type
    with torch.inference_mode():
        for module in model.modules():
            layer = getattr(module, "lora", None)
            if isinstance(layer, LoraLayer):
                if device in BATCHED_DEVICES:
                    layer.stacked()
                else:
                    layer.dense()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m textgate.bench.micro.lora", description=__doc__
    )
    parser.add_argument("--model", default=None, help="model folder (default: the embedded one)")
    parser.add_argument("--dtype", default="float32", help="as the launcher's --dtype")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--save-adapters",
        metavar="DIR",
        default=None,
        help="keep the random adapters in DIR/lora0, DIR/lora1, ... (for a serving run: "
        "textgate-launcher --lora-adapters lora0=DIR/lora0,...) instead of a temporary folder",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model_dir = Path(args.model) if args.model else default_model_dir()
    with contextlib.ExitStack() as stack:
        if args.save_adapters is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        else:
            folder = Path(args.save_adapters)
        adapters = make_adapters(model_dir, folder, args.adapters, args.rank)
        model = load_model(
            model_dir,
            model_dir.name,
            args.dtype,
            cache_config=CacheConfig(BLOCK_SIZE, 1 << 30),
            lora_adapters=adapters,
            lora_limits=LoraLimits(max_loras=len(adapters) + 1, max_rank=args.rank),
        )
        assert isinstance(model, PagedModel)
        names = [name for name, _ in adapters]
        started = time.perf_counter()
        model.lora.add(model.lora.read("extra", Path(adapters[0][1])))
        loaded = time.perf_counter()
        model.lora.reside([*names, "extra"])
        fold(model.model)  # what the next step pays for the swap
        load_ms, attach_ms = (
            (t - s) * 1e3 for s, t in ((started, loaded), (loaded, time.perf_counter()))
        )
        model.lora.reside(names)  # evicted: the steps run exactly --adapters
    model.warmup(pb.WarmupRequest(max_prefill_tokens=args.prompt_len))
    decode: dict[str, list[float]] = {"base": [], "lora": []}
    prefill: dict[str, list[float]] = {"base": [], "lora": []}
    for round_index in range(args.rounds):
        for side, using in (("base", ()), ("lora", names)):
            first = (2 * round_index + (side == "lora")) * 10_000
            seconds, decodes = time_batch(
                model, args.batch, args.prompt_len, args.steps, first, using
            )
            decode[side].append(statistics.median(decodes))
            prefill[side].append(seconds)
    print(
        f"{model_dir.name}, {model.model.dtype}, {torch.get_num_threads()} threads: batch "
        f"{args.batch}, {args.adapters} adapters of rank {args.rank} mixed evenly"
    )
    prompt_tokens = args.batch * args.prompt_len
    for name, tokens, seconds in (
        ("decode tok/s", args.batch, decode),
        (f"prefill tok/s ({args.batch} prompts of {args.prompt_len})", prompt_tokens, prefill),
    ):
        base, lora = (tokens / min(seconds[side]) for side in ("base", "lora"))
        paired = statistics.median(
            b / a for b, a in zip(seconds["base"], seconds["lora"], strict=True)
        )
        print(
            f"{name}: base {base:.1f}, with adapters {lora:.1f}, ratio {lora / base:.2f} "
            f"(best rounds); median of the rounds' ratios {paired:.2f}"
        )
    print(f"one adapter load + attach: {load_ms:.0f} + {attach_ms:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
