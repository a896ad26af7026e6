"""Each `textgate quantize` method's per-layer step (RTN, GPTQ, AWQ), registered by name.

A step sees one decoder layer and the calibration hidden states entering it, and returns
the layer's quantized linear weights (by checkpoint name under the layer; a
mixture-of-experts block's experts one linear each, see `experts.py`) and the hidden
states for the next layer;
`quantize.quantize_model` runs the chosen step over every decoder layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from textgate.kernels.packing import UnpackedWeight, dequantize
from textgate.quantization.algorithms.awq_search import apply_clip, search_clip, search_scales
from textgate.quantization.algorithms.experts import (
    CHECKPOINT_NAMES,
    ExpertInputs,
    layer_experts,
    quantize_experts,
)
from textgate.quantization.algorithms.gptq_solver import (
    HessianAccumulator,
    gptq_quantize,
    split_rows,
)
from textgate.quantization.algorithms.layers import (
    LINEAR_NAMES,
    CalibrationBatch,
    input_groups,
    linear,
    observe_inputs,
)
from textgate.quantization.algorithms.rtn import QuantSpec, rtn_quantize
from textgate.registry import Registry

if TYPE_CHECKING:
    from textgate.quantization.algorithms.quantize import QuantizeOptions

#: A method's per-layer step: (decoder layer, calibration batch, options, model config)
#: -> (quantized linears by name under the layer, hidden states for the next layer).
LayerQuantizer = Callable[
    [nn.Module, CalibrationBatch | None, "QuantizeOptions", Mapping[str, Any]],
    tuple[dict[str, UnpackedWeight], Tensor | None],
]
LAYER_QUANTIZERS: Registry[LayerQuantizer] = Registry("quantize method")


def register(name: str) -> Callable[[LayerQuantizer], LayerQuantizer]:
    """Register a method's per-layer step under its `--method` name."""
    return LAYER_QUANTIZERS.register(name)


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run the per-column and per-candidate loops on one thread.

    They are thousands of small ops, where OpenMP's barriers cost more than the work as
    soon as the cores are shared: measured on the 2-core CI machine under load, one GPTQ
    decoder layer 0.6-0.9 s on one thread vs 1.2-7.9 s on two; one AWQ layer 3.7 s vs
    15-22 s. The forward passes and Hessian products keep every thread.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _set_weight(layer: nn.Module, name: str, weight: UnpackedWeight) -> None:
    """Replace a linear's float weight by its quantized values (what a loader rebuilds)."""
    module = linear(layer, name)
    module.weight.data = dequantize(weight, module.weight.dtype)


@register("rtn")
def _rtn_layer(
    layer: nn.Module,
    batch: CalibrationBatch | None,
    options: QuantizeOptions,
    config: Mapping[str, Any],
) -> tuple[dict[str, UnpackedWeight], Tensor | None]:
    names = [name for group in input_groups(layer) for name in group]
    quantized = {n: rtn_quantize(linear(layer, n).weight, options.spec) for n in names}
    experts = layer_experts(layer)
    if experts is not None:

        def rtn(weight: Tensor, hessian: Tensor | None) -> UnpackedWeight:
            return rtn_quantize(weight, options.spec)

        quantized |= quantize_experts(experts, CHECKPOINT_NAMES[config["model_type"]], rtn, None)
    return quantized, None


@register("gptq")
def _gptq_layer(
    layer: nn.Module,
    batch: CalibrationBatch | None,
    options: QuantizeOptions,
    config: Mapping[str, Any],
) -> tuple[dict[str, UnpackedWeight], Tensor | None]:
    """Hessians from the float layer, GPTQ per input group and per expert (on the tokens
    routed to it), then the quantized layer's outputs."""
    assert batch is not None
    groups = input_groups(layer)
    observed = [group[0] for group in groups]
    hessians = {n: HessianAccumulator(linear(layer, n).in_features) for n in observed}
    experts = layer_experts(layer)
    routed = None if experts is None else ExpertInputs(experts, options.min_expert_tokens)
    with (
        observe_inputs(layer, observed, lambda name, x: hessians[name].add(x)),
        routed.observing() if routed is not None else nullcontext(),
    ):
        batch.run(layer)

    def solve(weight: Tensor, hessian: Tensor | None) -> UnpackedWeight:
        assert hessian is not None
        with _one_thread():
            return gptq_quantize(
                weight, hessian, options.spec, desc_act=options.desc_act, percdamp=options.percdamp
            )

    quantized = {}
    for group in groups:
        modules = [linear(layer, name) for name in group]
        stacked = solve(torch.cat([m.weight for m in modules]), hessians[group[0]].result())
        parts = split_rows(stacked, [m.out_features for m in modules])  # [Σ out, in] cut back
        for name, part in zip(group, parts, strict=True):
            quantized[name] = part
            _set_weight(layer, name, part)
    if experts is not None and routed is not None:
        routed.log_fallbacks(f"layer {getattr(layer.self_attn, 'layer_idx', '?')}")
        names = CHECKPOINT_NAMES[config["model_type"]]
        quantized |= quantize_experts(experts, names, solve, routed)
    # The next layer calibrates on what this quantized layer really outputs.
    return quantized, batch.run(layer)


class _InputStats:
    """Per observed linear: mean |x| over every calibration row, and a fixed row sample."""

    def __init__(self, sample_rows: int, total_rows: int) -> None:
        self.stride = max(1, total_rows // sample_rows)
        self.abs_sum: dict[str, Tensor] = {}
        self.rows: dict[str, list[Tensor]] = {}
        self.count: dict[str, int] = {}

    def observe(self, name: str, inputs: Tensor) -> None:
        rows = inputs.reshape(-1, inputs.shape[-1]).float()
        self.abs_sum[name] = self.abs_sum.get(name, 0) + rows.abs().sum(dim=0)
        self.count[name] = self.count.get(name, 0) + rows.shape[0]
        self.rows.setdefault(name, []).append(rows[:: self.stride].clone())

    def mean_abs(self, name: str) -> Tensor:
        return self.abs_sum[name] / self.count[name]

    def sample(self, name: str) -> Tensor:
        return torch.cat(self.rows[name])


@register("awq")
def _awq_layer(
    layer: nn.Module,
    batch: CalibrationBatch | None,
    options: QuantizeOptions,
    config: Mapping[str, Any],
) -> tuple[dict[str, UnpackedWeight], Tensor | None]:
    """Scale search per input-sharing group, folded into the op before it; clip; round.

    As AutoAWQ does, the next layer calibrates on this layer's float outputs.
    """
    assert batch is not None
    observed = ["self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"]
    stats = _InputStats(options.search_tokens, batch.hidden.shape[0] * batch.hidden.shape[1])
    with observe_inputs(layer, observed, stats.observe):
        next_hidden = batch.run(layer)
    with _one_thread():
        return _awq_search_and_round(layer, stats, options), next_hidden


def _awq_search_and_round(
    layer: nn.Module, stats: _InputStats, options: QuantizeOptions
) -> dict[str, UnpackedWeight]:
    observed = list(stats.rows)
    spec = options.spec
    attn, mlp = layer.self_attn, layer.mlp
    inputs = {name: stats.sample(name) for name in observed}

    def scale_group(
        source: str, names: list[str], fold: Callable[[Tensor], None], **kw: Any
    ) -> None:
        weights = [linear(layer, n).weight for n in names]
        scales = _awq_scales(inputs[source], stats.mean_abs(source), weights, spec, **kw)
        fold(scales)
        for weight in weights:
            weight.data *= scales  # columns: W·diag(s)
        inputs[source] = inputs[source] / scales  # what the scaled layers now receive

    scale_group(
        "self_attn.q_proj",
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        lambda s: _divide_(layer.input_layernorm.weight, s),
    )
    if attn.v_proj.out_features == attn.o_proj.in_features:
        # v's output channels are o's input channels only without grouped-query attention.
        scale_group(
            "self_attn.o_proj", ["self_attn.o_proj"], lambda s: _divide_rows(attn.v_proj, s)
        )
    scale_group(
        "mlp.gate_proj",
        ["mlp.gate_proj", "mlp.up_proj"],
        lambda s: _divide_(layer.post_attention_layernorm.weight, s),
        inspect=_mlp_output(mlp.down_proj.weight.detach().clone()),
    )
    scale_group("mlp.down_proj", ["mlp.down_proj"], lambda s: _divide_rows(mlp.up_proj, s))

    if options.clip:
        clip_inputs = {
            "self_attn.v_proj": "self_attn.q_proj",
            "self_attn.o_proj": "self_attn.o_proj",
            "mlp.gate_proj": "mlp.gate_proj",
            "mlp.up_proj": "mlp.gate_proj",
            "mlp.down_proj": "mlp.down_proj",
        }  # q/k are left unclipped: attention scores amplify their errors (as AutoAWQ)
        for name, source in clip_inputs.items():
            module = linear(layer, name)
            clip_rows = inputs[source][:_CLIP_TOKENS]
            bounds = search_clip(clip_rows, module.weight, spec)
            module.weight.data = apply_clip(module.weight, bounds, spec)
    return {n: rtn_quantize(linear(layer, n).weight, spec) for n in LINEAR_NAMES}


# Rows the clipping search evaluates on (AutoAWQ uses 512 tokens).
_CLIP_TOKENS = 512


def _awq_scales(
    inputs: Tensor, mean_abs: Tensor, weights: list[Tensor], spec: QuantSpec, **kw: Any
) -> Tensor:
    scales, _, _ = search_scales(inputs, weights, spec, mean_abs=mean_abs, **kw)
    return scales


def _mlp_output(down: Tensor) -> Callable[[Tensor, list[Tensor]], Tensor]:
    """The MLP's output with candidate gate/up weights (down kept in float)."""

    def inspect(x: Tensor, weights: list[Tensor]) -> Tensor:
        gate, up = weights
        return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T

    return inspect


def _divide_(weight: Tensor, scales: Tensor) -> None:
    weight.data /= scales


def _divide_rows(module: nn.Linear, scales: Tensor) -> None:
    """Divide the output rows of `module` (and its bias) by the next layer's input scales."""
    module.weight.data /= scales.unsqueeze(1)
    if module.bias is not None:
        module.bias.data /= scales
