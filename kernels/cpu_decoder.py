"""Int8 decoder layers in one C call per step (cpu_decoder.c).

A Llama-family layer on the CPU with `--quantize int8` is nine C kernels: two fused norms,
three int8 linears and one more for the output projection, rotary-and-store, paged attention,
silu-and-mul. Called one by one from the layers' modules, each costs PyTorch module dispatch,
a few tensor allocations and a ctypes call around a kernel that, at decode sizes, reads a
few hundred kilobytes of weights in tens of microseconds. `Int8DecoderStack` makes the same
calls, in the same order on the same kinds of buffers, from C: the bytes out are the
modules' bytes, and the Python between the kernels is gone.

On a 2-core Sapphire Rapids-class Xeon, SmolLM2-135M, `--quantize int8 --dtype float32`,
the decode step took 0.52x the modules' time at batch 1, 0.68x at 8 and 0.82x at 32
(`python -m textgate.bench.micro.step --quantize int8 --dtype float32 --batch 1,8,32`, with
and without `--no-int8-stack`; docs/quantization.md has the table).

`model.forward` builds one (`Int8DecoderStack.from_layers`, None where any layer does not
fit: not int8 on these kernels, LoRA attached, tensor parallel, q/k norms, MoE, another
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
from textgate.kernels.int8_linear import Int8Linear, PackedInt8Weight

_pointer, _int64, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Int8Weights(ctypes.Structure):
    _fields_ = [
        ("packed", _pointer),
        ("wsum", _pointer),
        ("wscale", _pointer),
        ("bias", _pointer),
        ("smooth", _pointer),
        ("in_features", _int64),
        ("out_features", _int64),
    ]


class _DecoderLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _pointer),
        ("post_norm", _pointer),
        ("input_eps", _float),
        ("post_eps", _float),
        ("qkv", _Int8Weights),
        ("o", _Int8Weights),
        ("gate_up", _Int8Weights),
        ("down", _Int8Weights),
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


@dataclass(frozen=True)
class DecoderLayerWeights:
    """What one layer gives the stack: its two RMSNorms' weights (in the activations' dtype)
    and epsilons, its four int8 linears (q/k/v fused, o, gate/up fused, down) and its
    attention's scale and sliding window (None: none)."""

    input_norm: Tensor
    input_eps: float
    post_norm: Tensor
    post_eps: float
    qkv: Int8Linear
    o: Int8Linear
    gate_up: Int8Linear
    down: Int8Linear
    scale: float
    window: int | None


def _int8_weights(linear: Int8Linear) -> _Int8Weights:
    packed = linear.packed_int8
    assert packed is not None

    def address(tensor: Tensor | None) -> int | None:
        return None if tensor is None else tensor.data_ptr()

    return _Int8Weights(
        packed.packed.data_ptr(),
        packed.offsets.data_ptr(),
        packed.scales.data_ptr(),
        address(packed.bias),
        address(linear.smooth),
        packed.in_features,
        packed.out_features,
    )


def _packed(linear: object) -> PackedInt8Weight | None:
    return linear.packed_int8 if isinstance(linear, Int8Linear) else None


class Int8DecoderStack:
    """A model's decoder layers, all int8 on cpu_int8.c, run as one C call per step."""

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
        self.intermediate = self._layers[0].gate_up.out_features // 2
        self.dtype = self._layers[0].input_norm.dtype
        self._structs = (_DecoderLayer * len(self._layers))()
        for struct, layer in zip(self._structs, self._layers, strict=True):
            struct.input_norm = layer.input_norm.data_ptr()
            struct.post_norm = layer.post_norm.data_ptr()
            struct.input_eps, struct.post_eps = layer.input_eps, layer.post_eps
            struct.qkv, struct.o = _int8_weights(layer.qkv), _int8_weights(layer.o)
            struct.gate_up, struct.down = _int8_weights(layer.gate_up), _int8_weights(layer.down)
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
    ) -> Int8DecoderStack | None:
        """The stack, or None where these layers do not fit it: no C kernels here, weights not
        packed for them, activations not float32/bfloat16, shapes that differ per layer."""
        library = cpu_build.load_library()
        if library is None or not layers:
            return None
        first = layers[0]
        dtype, hidden = first.input_norm.dtype, first.input_norm.shape[0]
        qkv_width = (num_heads + 2 * num_kv_heads) * head_dim
        for layer in layers:
            linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
            if any(_packed(linear) is None for linear in linears):
                return None
            norms = (layer.input_norm, layer.post_norm)
            if any(
                norm.dtype != dtype or norm.shape != (hidden,) or not norm.is_contiguous()
                for norm in norms
            ):
                return None
            intermediate = layer.gate_up.out_features // 2
            shapes = [(linear.in_features, linear.out_features) for linear in linears]
            if shapes != [
                (hidden, qkv_width),
                (num_heads * head_dim, hidden),
                (hidden, 2 * intermediate),
                (intermediate, hidden),
            ] or shapes[2] != (first.gate_up.in_features, first.gate_up.out_features):
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
