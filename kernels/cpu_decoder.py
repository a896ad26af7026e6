"""Decoder layers in one C call per step (cpu_decoder.c), int8 or float.

A Llama-family layer on the CPU is nine C kernels: two fused norms, three linears and one
more for the output projection, rotary-and-store, paged attention, silu-and-mul. The
linears are int8 (`--quantize int8`, cpu_int8.c) or dense float32/bfloat16 (the default,
cpu_dense.c). Called one by one from the layers' modules, each costs PyTorch module
dispatch, a few tensor allocations and a ctypes call around a kernel that, at decode sizes,
reads a few hundred kilobytes of weights in tens of microseconds. `DecoderStack` makes the
same calls, in the same order on the same kinds of buffers, from C: the bytes out are the
modules' bytes, and the Python between the kernels is gone.

On a 2-core Sapphire Rapids-class Xeon, SmolLM2-135M, `--quantize int8 --dtype float32`,
the decode step took 0.52x the modules' time at batch 1, 0.68x at 8 and 0.82x at 32
(`python -m textgate.bench.micro.step --quantize int8 --dtype float32 --batch 1,8,32`, with
and without `--no-decoder-stack`; docs/quantization.md has the table).

`model.forward` builds one (`DecoderStack.build`, None where any layer does not fit: its
linears on neither kernel, LoRA attached, tensor parallel, q/k norms, MoE, another
activation) and calls `run` per step, which returns None where the step does not fit
(a quantized KV cache, prompt chunks the attention backend sends to SDPA, a partial
rotary); the modules then run as before.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from textgate.kernels import cpu_build
from textgate.kernels.cpu_attention import SUPPORTED_DTYPES, KernelBatch
from textgate.kernels.int8_linear import Int8Linear
from textgate.kernels.linear import FastLinear

_pointer, _int64, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _LinearWeights(ctypes.Structure):
    _fields_ = [
        ("kind", _int64),
        ("packed", _pointer),
        ("wsum", _pointer),
        ("wscale", _pointer),
        ("bias", _pointer),
        ("smooth", _pointer),
        ("in_features", _int64),
        ("out_features", _int64),
    ]


_INT8, _DENSE = 0, 1
"""`_LinearWeights.kind`: cpu_int8.c or cpu_dense.c."""


class _DecoderLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _pointer),
        ("post_norm", _pointer),
        ("input_eps", _float),
        ("post_eps", _float),
        ("qkv", _LinearWeights),
        ("o", _LinearWeights),
        ("gate_up", _LinearWeights),
        ("down", _LinearWeights),
        ("key_cache", _pointer),
        ("value_cache", _pointer),
        ("scale", _float),
        ("window", _int64),
    ]


class _DecoderStep(ctypes.Structure):
    _fields_ = [
        *[
            (name, _int64)
            for name in ("rows", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate")
        ],
        ("bf16", ctypes.c_int),
        ("cos", _pointer),
        ("sin_signed", _pointer),
        *[
            (name, _pointer)
            for name in ("slot_mapping", "query_starts", "query_lens", "seq_lens", "block_tables")
        ],
        *[(name, _int64) for name in ("num_seqs", "max_blocks", "block_size", "max_seq_len")],
        *[
            (name, _pointer)
            for name in ("normed", "qkv", "query", "attended", "gate_up", "activated")
        ],
    ]


StackLinear = Int8Linear | FastLinear
"""A linear the stack runs: int8 on cpu_int8.c, or dense on cpu_dense.c."""


@dataclass(frozen=True)
class DecoderLayerWeights:
    """What one layer gives the stack: its two RMSNorms' weights (in the activations' dtype)
    and epsilons, its four linears (q/k/v fused, o, gate/up fused, down) and its attention's
    scale and sliding window (None: none)."""

    input_norm: Tensor
    input_eps: float
    post_norm: Tensor
    post_eps: float
    qkv: StackLinear
    o: StackLinear
    gate_up: StackLinear
    down: StackLinear
    scale: float
    window: int | None


def _address(tensor: Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _features(linear: StackLinear) -> tuple[int, int]:
    """(in_features, out_features) of a linear the stack runs (`_runs`)."""
    if isinstance(linear, Int8Linear):
        assert linear.packed_int8 is not None
        return linear.packed_int8.in_features, linear.packed_int8.out_features
    assert linear.kernel_packed is not None
    return linear.kernel_packed.in_features, linear.kernel_packed.out_features


def _runs(linear: object, dtype: torch.dtype) -> bool:
    """Whether the stack's kernels run this linear for activations of `dtype`: int8 packed
    for cpu_int8.c, or dense packed for cpu_dense.c in that dtype."""
    if isinstance(linear, Int8Linear):
        return linear.packed_int8 is not None
    if isinstance(linear, FastLinear):
        packed = linear.kernel_packed
        return packed is not None and packed.dtype == dtype
    return False


def _linear_weights(linear: StackLinear) -> _LinearWeights:
    if isinstance(linear, FastLinear):
        dense = linear.kernel_packed
        assert dense is not None
        return _LinearWeights(
            _DENSE, dense.packed.data_ptr(), None, None, _address(dense.bias), None,
            dense.in_features, dense.out_features,
        )  # fmt: skip
    packed = linear.packed_int8
    assert packed is not None
    return _LinearWeights(
        _INT8, packed.packed.data_ptr(), packed.offsets.data_ptr(), packed.scales.data_ptr(),
        _address(packed.bias), _address(linear.smooth), packed.in_features, packed.out_features,
    )  # fmt: skip


class DecoderStack:
    """A model's decoder layers, their linears int8 (cpu_int8.c) or dense (cpu_dense.c), run
    as one C call per step."""

    def __init__(
        self,
        layers: Sequence[DecoderLayerWeights],
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        library: ctypes.CDLL,
    ) -> None:
        self._layers = list(layers)  # keeps every tensor the C structs point at alive
        self._library = library
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.hidden = self._layers[0].input_norm.shape[0]
        self.intermediate = _features(self._layers[0].gate_up)[1] // 2
        self.dtype = self._layers[0].input_norm.dtype
        self._structs = (_DecoderLayer * len(self._layers))()
        for struct, layer in zip(self._structs, self._layers, strict=True):
            struct.input_norm = layer.input_norm.data_ptr()
            struct.post_norm = layer.post_norm.data_ptr()
            struct.input_eps, struct.post_eps = layer.input_eps, layer.post_eps
            struct.qkv, struct.o = _linear_weights(layer.qkv), _linear_weights(layer.o)
            struct.gate_up = _linear_weights(layer.gate_up)
            struct.down = _linear_weights(layer.down)
            struct.scale, struct.window = layer.scale, layer.window or 0
        self._caches_key: tuple[int, ...] = ()
        """Which caches the layers point at (see `_attach_caches`)."""

    @classmethod
    def build(
        cls,
        layers: Sequence[DecoderLayerWeights],
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> DecoderStack | None:
        """The stack, or None where these layers do not fit it: no C kernels here, weights not
        packed for them (or dense in another dtype than the activations), activations not
        float32/bfloat16, shapes that differ per layer."""
        library = cpu_build.load_library()
        if library is None or not layers:
            return None
        first = layers[0]
        dtype, hidden = first.input_norm.dtype, first.input_norm.shape[0]
        qkv_width = (num_heads + 2 * num_kv_heads) * head_dim
        for layer in layers:
            linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
            if any(not _runs(linear, dtype) for linear in linears):
                return None
            norms = (layer.input_norm, layer.post_norm)
            if any(
                norm.dtype != dtype or norm.shape != (hidden,) or not norm.is_contiguous()
                for norm in norms
            ):
                return None
            shapes = [_features(linear) for linear in linears]
            intermediate = shapes[2][1] // 2
            if shapes != [
                (hidden, qkv_width),
                (num_heads * head_dim, hidden),
                (hidden, 2 * intermediate),
                (intermediate, hidden),
            ] or shapes[2] != _features(first.gate_up):
                return None
        if dtype not in SUPPORTED_DTYPES:
            return None
        return cls(
            layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            library=library,
        )

    def _attach_caches(self, key_caches: Sequence[Tensor], value_caches: Sequence[Tensor]) -> bool:
        """Point the layers at their caches; False where the kernels cannot read them in
        place (not in the activations' dtype, not contiguous). A step's lists are the
        model's, so the pointers are set once per cache, not per step."""
        key = (id(key_caches), id(value_caches), key_caches[0].data_ptr(), len(key_caches))
        if key == self._caches_key:
            return True
        caches = list(zip(key_caches, value_caches, strict=True))
        if len(caches) != len(self._structs) or any(
            tensor.dtype != self.dtype or not tensor.is_contiguous()
            for pair in caches
            for tensor in pair
        ):
            return False
        for struct, (key_cache, value_cache) in zip(self._structs, caches, strict=True):
            struct.key_cache, struct.value_cache = key_cache.data_ptr(), value_cache.data_ptr()
        self._caches_key = key
        return True

    def _fits(self, hidden: Tensor, cos: Tensor, sin_signed: Tensor, slot_mapping: Tensor) -> bool:
        """Whether the kernels read this step's inputs as they are."""
        rows = hidden.shape[0]
        rotary = (rows, self.head_dim)
        return (
            hidden.dtype == self.dtype
            and hidden.shape == (rows, self.hidden)
            and cos.dtype == self.dtype
            and cos.shape == rotary
            and sin_signed.shape == rotary
            and slot_mapping.dtype == torch.int64
            and cos.is_contiguous()
            and sin_signed.is_contiguous()
            and slot_mapping.is_contiguous()
        )

    def _scratch(self, rows: int) -> list[Tensor]:
        """The step's scratch buffers, in `_DecoderStep`'s order: normed, qkv, query,
        attended, gate_up, activated."""
        q_width = self.num_heads * self.head_dim
        widths = [
            self.hidden,
            q_width + 2 * self.num_kv_heads * self.head_dim,
            q_width,
            q_width,
            2 * self.intermediate,
            self.intermediate,
        ]
        return [torch.empty(rows, width, dtype=self.dtype) for width in widths]

    def run(
        self,
        hidden: Tensor,
        residual: Tensor | None,
        cos: Tensor,
        sin_signed: Tensor,
        slot_mapping: Tensor,
        key_caches: Sequence[Tensor],
        value_caches: Sequence[Tensor],
        batch: KernelBatch,
    ) -> tuple[Tensor, Tensor] | None:
        """Every layer over `hidden` [T, hidden] (the residual stream so far, or None before
        the first layer): (the last layer's output, the residual stream), or None where this
        step does not fit (then nothing was written)."""
        if not self._fits(hidden, cos, sin_signed, slot_mapping) or not self._attach_caches(
            key_caches, value_caches
        ):
            return None
        rows = hidden.shape[0]
        hidden = hidden.contiguous().clone()  # written in place by every layer
        out_residual = (
            torch.empty_like(hidden) if residual is None else residual.contiguous().clone()
        )
        buffers = self._scratch(rows)  # alive until the call returns
        step = _DecoderStep(
            rows,
            self.hidden,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate,
            SUPPORTED_DTYPES[self.dtype],
            cos.data_ptr(),
            sin_signed.data_ptr(),
            slot_mapping.data_ptr(),
            *batch.kernel_args(),
            key_caches[0].shape[1],
            batch.max_seq_len,
            *(buffer.data_ptr() for buffer in buffers),
        )
        failed = self._library.textgate_decoder_layers(
            ctypes.addressof(step),
            ctypes.addressof(self._structs),
            len(self._structs),
            hidden.data_ptr(),
            out_residual.data_ptr(),
            int(residual is not None),
        )
        if failed:
            raise MemoryError(f"textgate_decoder_layers failed ({failed}) for {rows} rows")
        return hidden, out_residual
