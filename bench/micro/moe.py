"""`python -m textgate.bench.micro.moe`: one mixture-of-experts layer's step, grouped by
expert against a per-token loop and against transformers' own block.

Builds one MoE MLP with random weights of the given shape (default: 32 experts of
hidden 1024 / intermediate 512, top 4) and times its forward over steps of T tokens
(a decode step of T sequences, or a prompt chunk of T tokens; the MLP cannot tell them
apart), interleaved round-robin, best window kept (`bench.micro.timing.best_seconds`),
every call on the next of 16 inputs so its experts are not the ones the last call left
in cache:

- `grouped`: textgate's `SparseMoE` as it serves, the (token, expert) pairs sorted by
  expert and run as one grouped matmul (`torch._grouped_mm`) where this torch has it;
- `per-expert`: the same, one matmul per active expert;
- `per-token`: the loop a plain implementation writes, every token through each of its
  k experts on its own;
- `hf-eager`, `hf-grouped_mm`: transformers' MixtralSparseMoeBlock with the same
  weights, under its loop over active experts and under its grouped matmul.

Prints microseconds per step and each candidate's speed relative to the per-token loop
(how many times faster), after checking that all of them agree.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from textgate.bench.micro.timing import best_seconds
from textgate.bench.serving.cli import parse_list
from textgate.bench.serving.report import format_table
from textgate.bench.serving.roofline import DTYPES
from textgate.shard_server.layers.mlp import silu_and_mul
from textgate.shard_server.layers.moe import SparseMoE, StackedExperts


@dataclass(frozen=True)
class MoEShape:
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int


@dataclass
class Layer:
    """One layer's weights: router [E, H], gate-up [E, 2 I, H], down [E, H, I]."""

    router: Tensor
    gate_up: Tensor
    down: Tensor
    top_k: int

    @classmethod
    def random(cls, shape: MoEShape, dtype: torch.dtype, seed: int = 0) -> Layer:
        generator = torch.Generator().manual_seed(seed)

        def weight(*size: int) -> Tensor:
            return (torch.randn(*size, generator=generator) * size[-1] ** -0.5).to(dtype)

        experts, hidden, inner = shape.num_experts, shape.hidden, shape.intermediate
        return cls(
            weight(experts, hidden),
            weight(experts, 2 * inner, hidden),
            weight(experts, hidden, inner),
            shape.top_k,
        )

    def textgate(self, grouped: bool) -> SparseMoE:
        experts = StackedExperts(self.gate_up, self.down)
        experts.grouped = experts.grouped and grouped
        return SparseMoE(
            self.router, experts, top_k=self.top_k, normalize_top_k=True, process_group=None
        )

    def per_token(self) -> Callable[[Tensor], Tensor]:
        def forward(hidden: Tensor) -> Tensor:
            probs = torch.softmax((hidden @ self.router.T).float(), dim=-1)
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
            weights = (weights / weights.sum(-1, keepdim=True)).to(hidden.dtype)
            out = torch.zeros_like(hidden)
            for token in range(hidden.shape[0]):
                row = hidden[token : token + 1]
                for weight, expert in zip(weights[token], experts[token].tolist(), strict=True):
                    act = silu_and_mul(row @ self.gate_up[expert].T)
                    out[token] += weight * (act @ self.down[expert].T)[0]
            return out

        return forward

    def transformers(self, implementation: str) -> torch.nn.Module:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        experts, inner2, hidden = self.gate_up.shape
        config = MixtralConfig(
            hidden_size=hidden,
            intermediate_size=inner2 // 2,
            num_local_experts=experts,
            num_experts_per_tok=self.top_k,
            experts_implementation=implementation,
        )
        block = MixtralSparseMoeBlock(config).eval()
        with torch.no_grad():
            block.gate.weight.copy_(self.router)
            block.experts.gate_up_proj.copy_(self.gate_up)
            block.experts.down_proj.copy_(self.down)
        return block.to(self.router.dtype)


TRANSFORMERS = ("eager", "grouped_mm")
"""transformers' experts implementations timed: its loop over active experts, and its
grouped matmul."""


def candidates(layer: Layer) -> dict[str, Callable[[Tensor], Tensor]]:
    fns: dict[str, Callable[[Tensor], Tensor]] = {
        "grouped": layer.textgate(grouped=True),
        "per-expert": layer.textgate(grouped=False),
        "per-token": layer.per_token(),
    }
    for implementation in TRANSFORMERS:
        block = layer.transformers(implementation)
        fns[f"hf-{implementation}"] = lambda hidden, block=block: block(hidden[None])[0]
    return fns


POOL = 16
"""Steps of different inputs each candidate cycles through: each routes to other experts,
so no candidate times a step whose few experts stayed in cache from its last call."""


def rotating(
    fns: dict[str, Callable[[Tensor], Tensor]], inputs: Sequence[Tensor]
) -> dict[str, Callable[[Tensor], Tensor]]:
    """Each candidate called on the next of `inputs` at every call (the argument ignored)."""

    def cycle(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
        calls = itertools.count()
        return lambda _: fn(inputs[next(calls) % len(inputs)])

    return {name: cycle(fn) for name, fn in fns.items()}


def check_agreement(fns: dict[str, Callable[[Tensor], Tensor]], x: Tensor) -> None:
    """Every candidate computes the same layer (a bench of wrong code measures nothing)."""
    reference = fns["per-token"](x).float()
    scale = reference.abs().max().item() or 1.0
    tolerance = 1e-4 if x.dtype == torch.float32 else 0.05
    for name, fn in fns.items():
        error = (fn(x).float() - reference).abs().max().item() / scale
        if error > tolerance:
            raise AssertionError(f"{name} differs from the per-token loop by {error:.2g}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m textgate.bench.micro.moe", description=__doc__)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512, help="each expert's")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument(
        "--tokens",
        type=lambda text: parse_list(text, int),
        default=[1, 8, 32, 128],
        help="tokens per step, comma-separated",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = MoEShape(args.hidden, args.intermediate, args.experts, args.top_k)
    dtype = DTYPES[args.dtype]
    layer = Layer.random(shape, dtype)
    fns = candidates(layer)
    generator = torch.Generator().manual_seed(1)
    rows = []
    with torch.inference_mode():
        for tokens in args.tokens:
            inputs = [
                torch.randn(tokens, shape.hidden, generator=generator).to(dtype)
                for _ in range(POOL)
            ]
            check_agreement(fns, inputs[0])
            best = best_seconds(rotating(fns, inputs), inputs[0], args.rounds)
            loop = best["per-token"]
            rows.append(
                [str(tokens)]
                + [f"{best[name] * 1e6:.0f}" for name in fns]
                + [f"{loop / best[name]:.2f}x" for name in fns if name != "per-token"]
            )
    grouped = fns["grouped"]
    assert isinstance(grouped, SparseMoE) and isinstance(grouped.experts, StackedExperts)
    print(
        f"MoE layer: hidden {shape.hidden}, {shape.num_experts} experts of {shape.intermediate}, "
        f"top {shape.top_k}, {args.dtype}, {torch.get_num_threads()} threads on "
        f"{os.cpu_count()} CPUs; grouped matmul {'on' if grouped.experts.grouped else 'off'}"
    )
    headers = ["T", *(f"{name} us" for name in fns)]
    headers += [f"{name} vs loop" for name in fns if name != "per-token"]
    print(format_table(headers, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
