"""W8A8 linear: per-output-channel int8 weights, per-token dynamic int8 activations.

Weights: `q_w = round(W / s_w)` with `s_w = absmax(W[row]) / 127`, one float32 scale per
output channel. Activations, per call: each row (token) x is scaled by its own absmax
`m`, `q_x = round(127 * x / m)` in [-127, 127], so one token's outliers never cost another
token precision and a request's output does not depend on what it is batched with. Then
`y = (q_x @ q_w.T) * (m / 127) * s_w + bias`, the product summed exactly in int32.

The fast path (`kernel="cpu"`) is one C call per layer, `textgate_int8_linear` in
cpu_int8.c: it quantizes the rows (times the layer's SmoothQuant factors, if any), sums
`(q_x + 128) * q_w` exactly in int32 on weights packed once at load (`pack_int8`),
subtracts `128 * colsum(q_w)`, scales by `m / 127 * s_w`, adds the bias and stores in the
input's dtype. The instructions that sum come from the level the kernels were built for
(kernels/cpu_isa.py): `vpdpbusd` with AVX512-VNNI, int16-widened `vpmaddwd` with AVX2
(exact: nothing saturates), plain C below that; every level gives the same bytes.
oneDNN's int8 GEMM (`onednn::qlinear_pointwise`, unsigned activations with the fixed zero
point 128 and scale 1/127, the per-row `m` applied to its float output by PyTorch) is the
fallback where the C kernels are unavailable, and only where it sums exactly
(`onednn_is_exact`: without VNNI it saturates).

Why our own kernel: oneDNN's path costs six dispatches per layer (quantize, the GEMM, the
row rescale, the bias, the dtype cast, a reshape), and at decode sizes those dominate.
Measured in one process, 1 thread (the 2-core AMD EPYC under load ~8 from other jobs,
which makes 2-thread timings meaningless; best of 40 round-robin windows), time / fp32
FastLinear's (lower is faster); `onednn` is the previous path, `vnni` this one:

    shape (in x out)  M    fp32 ms  bf16  onednn  vnni
    576x960           1    0.038    0.70  0.97    0.33
    576x960           32   0.157    0.58  0.53    0.41
    576x960           512  2.957    0.43  0.32    0.31
    576x576           1    0.029    0.77  1.14    0.33
    576x576           32   0.102    0.59  0.65    0.42
    576x576           512  1.362    0.55  0.44    0.46
    576x3072          1    0.091    0.64  1.33    0.31
    576x3072          32   0.587    0.51  0.35    0.31
    1536x576          1    0.053    0.67  0.79    0.34
    1536x576          32   0.293    0.48  0.42    0.36
    1536x576          512  3.653    0.53  0.41    0.43
    576x49152         1    3.141    0.59  0.29    0.34

(Cells whose fp32 baseline was itself disturbed, 576x3072 at M=512 and the head at
M>=32, are left out; there `vnni` and `onednn` were equal, 0.07-0.36.)
`vnni` is 2-3x faster than `onednn` at M=1 and as fast or faster at M=32; at M=512 the two
are within noise, so one kernel serves decode and prefill. Against bf16 (the `--dtype auto`
pick on AVX512-BF16 CPUs) it is 1.4-2.1x per layer at M=1..32: VNNI does 64 int8
multiply-adds per 512-bit instruction, `vdpbf16ps` 32 bf16 ones, so 2x is the ceiling.
The earlier table of torch.ao, `torch._int_mm` and `aten._weight_int8pack_mm` candidates is
in git history (`python -m textgate.bench.micro.int8_linear`); none beat oneDNN's path at M=32.

`reference_int8_linear` (dequantize then matmul in float32) is the definition; it runs
wherever the fast paths cannot (GPU, `TEXTGATE_CPU_KERNELS=0` on a CPU whose oneDNN
would saturate).
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from textgate.kernels import cpu_build

INT8_MAX = 127
# oneDNN's int8 GEMM takes unsigned activations: q_x + 128 in [1, 255].
ZERO_POINT = 128
_TINY = 1e-12
_C_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def quantize_weight(weight: Tensor, smooth: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-output-channel symmetric int8 of a weight [out, in]: (q_w int8 [out, in],
    s_w float32 [out]) with W ≈ q_w * s_w[:, None]; with per-input-channel factors
    `smooth` [in], of W / smooth instead (the layer then multiplies its input by smooth)."""
    weight = weight.float() if smooth is None else weight.float() / smooth
    scales = weight.abs().amax(dim=1).clamp(min=_TINY) / INT8_MAX  # [out]
    qweight = torch.round(weight / scales[:, None]).clamp(-INT8_MAX, INT8_MAX)
    return qweight.to(torch.int8), scales


def reference_quantize_rows(x: Tensor, smooth: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-token symmetric int8 of x [M, K] (times the per-column factors `smooth` [K] when
    given), offset to uint8: (q_x + 128 uint8 [M, K], row absmax m float32 [M, 1]) with
    x * smooth ≈ (q - 128) * m / 127."""
    x = x.float() if smooth is None else x.float() * smooth
    row_max = x.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY)  # [M, 1]
    quantized = torch.round(x * (row_max.reciprocal() * INT8_MAX)).add_(ZERO_POINT)
    return quantized.to(torch.uint8), row_max


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """`reference_quantize_rows` in one C pass (cpu_int8.c) where the CPU kernels run,
    byte for byte the same; the reference elsewhere."""
    library = cpu_build.load_library() if x.device.type == "cpu" else None
    if library is None or x.dtype not in _C_DTYPES or x.dim() != 2 or not x.is_contiguous():
        return reference_quantize_rows(x)
    quantized = torch.empty(x.shape, dtype=torch.uint8)
    row_max = torch.empty(x.shape[0], 1)
    library.textgate_quantize_rows(
        x.data_ptr(), quantized.data_ptr(), row_max.data_ptr(), x.shape[0], x.shape[1],
        _C_DTYPES[x.dtype],
    )  # fmt: skip
    return quantized, row_max


def reference_int8_linear(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    bias: Tensor | None = None,
    smooth: Tensor | None = None,
) -> Tensor:
    """`x @ W.T + bias` for x [..., in] with W8A8: both operands quantized, dequantized,
    then multiplied in float32; the result in x's dtype [..., out]. With `smooth` [in], the
    weight was quantized as W / smooth (see `quantize_weight`) and x is multiplied by it."""
    rows = x.reshape(-1, x.shape[-1])  # [M, in]
    quantized, row_max = reference_quantize_rows(rows, smooth)
    dequantized = (quantized.float() - ZERO_POINT) * (row_max / INT8_MAX)  # [M, in]
    out = dequantized @ (qweight.float() * scales[:, None]).t()  # [M, out]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])


def can_pack() -> bool:
    """Whether the oneDNN int8 GEMM is available (CPU builds with oneDNN, kernels on)."""
    if os.environ.get("TEXTGATE_CPU_KERNELS", "1") == "0":
        return False
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")


def pack(qweight: Tensor) -> Tensor | None:
    """q_w [out, in] in oneDNN's layout for `packed_int8_linear`, or None off the CPU."""
    if qweight.device.type != "cpu" or not can_pack():
        return None
    # No input-shape hint: the layout then suits every row count (decode and prefill).
    return torch.ops.onednn.qlinear_prepack(qweight, None)


def packed_int8_linear(
    x: Tensor,
    packed: Tensor,
    scales: Tensor,
    zero_points: Tensor,
    bias: Tensor | None = None,
    smooth: Tensor | None = None,
) -> Tensor:
    """`reference_int8_linear` on oneDNN's int8 GEMM: `packed = pack(q_w)`, `zero_points`
    int32 zeros [out]; equal to the reference up to float summation order where oneDNN sums
    exactly (`onednn_is_exact`)."""
    rows = x.reshape(-1, x.shape[-1])  # [M, in]
    if smooth is not None:
        rows = rows.float() * smooth
    quantized, row_max = quantize_rows(rows)
    out = torch.ops.onednn.qlinear_pointwise(
        quantized, 1.0 / INT8_MAX, ZERO_POINT, packed, scales, zero_points,
        None, 1.0, 0, torch.float32, "none", [], "",
    )  # [M, out] float32: (q_x @ q_w.T) * s_w / 127  # fmt: skip
    out = out.mul_(row_max) if bias is None else torch.addcmul(bias.float(), out, row_max)
    return out.to(x.dtype).reshape(*x.shape[:-1], scales.shape[0])


def onednn_is_exact() -> bool:
    """Whether oneDNN's int8 GEMM sums exactly on this CPU, tried on the worst case.

    Without a dot-product instruction (no VNNI: AVX2, AVX512 before Cascade Lake), oneDNN
    sums pairs of u8 x s8 products with `vpmaddubsw`, which saturates at int16: 255 * 127
    twice is 64,770. PyTorch's x86 quantization halves the activations' range there; W8A8
    at full range would be silently wrong (logits 6% off on an AVX2 EPYC), so such a GEMM
    is not used. Also False where oneDNN is unavailable.
    """
    return can_pack() and _onednn_sums_exactly()


@functools.cache
def _onednn_sums_exactly() -> bool:
    rows, inputs = 2, 64
    qweight = torch.full((16, inputs), INT8_MAX, dtype=torch.int8)
    qweight[1::2] = -INT8_MAX  # both signs saturate
    packed = pack(qweight)
    if packed is None:
        return False
    x = torch.ones(rows, inputs)  # q_x + 128 = 255: the largest products
    scales = torch.ones(16)
    got = packed_int8_linear(x, packed, scales, torch.zeros(16, dtype=torch.int32))
    return torch.allclose(got, reference_int8_linear(x, qweight, scales), rtol=1e-5, atol=1e-3)


CPU_INT8_ISAS = {2: "avx512-vnni", 1: "avx2", 0: "portable"}
"""`textgate_int8_isa()` of the loaded kernels: which instructions sum the products (and so
which weight layout `pack_int8` makes, cpu_int8.c)."""


def cpu_kernel_isa() -> int | None:
    """What cpu_int8.c's layer runs on here (a key of CPU_INT8_ISAS), None without kernels."""
    if os.environ.get("TEXTGATE_CPU_KERNELS", "1") == "0":
        return None
    library = cpu_build.load_library()
    return None if library is None else int(library.textgate_int8_isa())


KERNELS = ("cpu", "onednn", "reference")


# The C kernel sums (q_x + 128) * q_w, each up to 255 * 127, in int32 without saturating.
MAX_IN_FEATURES = (2**31 - 1) // (255 * 127)


def default_kernel(device: torch.device, in_features: int = 0) -> str:
    """The fastest int8 kernel that runs correctly on `device`: cpu_int8.c where it has an
    int8 instruction set (VNNI or AVX2), else oneDNN where it sums exactly, else cpu_int8.c
    in plain C, else the reference (see the module docstring)."""
    if device.type != "cpu":
        return "reference"
    isa = cpu_kernel_isa()
    fits = in_features <= MAX_IN_FEATURES
    if isa is not None and isa > 0 and fits:
        return "cpu"
    if onednn_is_exact():
        return "onednn"
    return "cpu" if isa is not None and fits else "reference"


def describe_kernel() -> str:
    """What `--quantize int8` layers run on this CPU, for /info and the log."""
    kernel = default_kernel(torch.device("cpu"))
    if kernel == "cpu":
        isa = cpu_kernel_isa()
        return f"cpu_int8.c ({CPU_INT8_ISAS[isa if isa is not None else 0]})"
    return {"onednn": "oneDNN int8 GEMM", "reference": "reference (dequantize + matmul)"}[kernel]


@dataclass(frozen=True)
class PackedInt8Weight:
    """q_w in the layout of cpu_int8.c's `textgate_int8_linear`, with its per-channel terms."""

    packed: Tensor  # int8 [N/16, K/4, 16, 4] (VNNI, plain C) or [N/16, K/2, 16, 2] (AVX2)
    offsets: Tensor  # int32 [N16]: 128 * sum_k q_w[n, k], what the uint8 offset of q_x adds
    scales: Tensor  # float32 [N16]: s_w / 127
    bias: Tensor | None  # float32 [N16]
    in_features: int
    out_features: int


def inputs_per_lane(isa: int) -> int:
    """Inputs of one output channel side by side in cpu_int8.c's layout for `isa`: VNNI
    sums four products per lane, AVX2's vpmaddwd two; plain C reads VNNI's layout."""
    return 2 if isa == 1 else 4


def pack_int8(
    qweight: Tensor, scales: Tensor, bias: Tensor | None = None, isa: int = 2
) -> PackedInt8Weight:
    """q_w [out, in] and s_w [out] packed for `cpu_int8_linear` on `isa` (a key of
    CPU_INT8_ISAS), N padded to 16, K to 4."""
    out_features, in_features = qweight.shape
    lane = inputs_per_lane(isa)
    n16, k4 = -(-out_features // 16) * 16, -(-in_features // 4) * 4
    padded = F.pad(qweight, (0, k4 - in_features, 0, n16 - out_features))  # [N16, K4]
    packed = padded.view(n16 // 16, 16, k4 // lane, lane).permute(0, 2, 1, 3).contiguous()
    offsets = padded.sum(dim=1, dtype=torch.int32) * ZERO_POINT
    padded_scales = F.pad(scales.float() / INT8_MAX, (0, n16 - out_features))
    padded_bias = None if bias is None else F.pad(bias.float(), (0, n16 - out_features))
    return PackedInt8Weight(packed, offsets, padded_scales, padded_bias, in_features, out_features)


def unpack_int8(weight: PackedInt8Weight) -> Tensor:
    """q_w [out, in] back from `pack_int8`."""
    blocks, groups, _, lane = weight.packed.shape
    plain = weight.packed.permute(0, 2, 1, 3).reshape(blocks * 16, groups * lane)
    return plain[: weight.out_features, : weight.in_features]


def _pointer(tensor: Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def cpu_int8_linear(
    x: Tensor,
    weight: PackedInt8Weight,
    smooth: Tensor | None = None,
    library: ctypes.CDLL | None = None,
) -> Tensor:
    """`reference_int8_linear` in one C call (quantize, int8 GEMM, dequantize, bias) for x
    [..., in] float32 or bfloat16; equal to the reference up to float summation order. The
    weight must be packed for the instruction set of `library` (default: the loaded
    kernels, `cpu_kernel_isa()`)."""
    library = library or cpu_build.load_library()
    assert library is not None
    rows = x.reshape(-1, x.shape[-1])  # [M, in]
    if rows.dtype not in _C_DTYPES:
        rows = rows.float()
    rows = rows.contiguous()
    out = torch.empty(rows.shape[0], weight.out_features, dtype=rows.dtype)  # [M, out]
    status = library.textgate_int8_linear(
        rows.data_ptr(), rows.shape[0], weight.in_features, _C_DTYPES[rows.dtype],
        _pointer(smooth), weight.packed.data_ptr(), weight.offsets.data_ptr(),
        weight.scales.data_ptr(), _pointer(weight.bias), out.data_ptr(), weight.out_features,
        _C_DTYPES[rows.dtype],
    )  # fmt: skip
    if status != 0:
        raise MemoryError(f"textgate_int8_linear failed ({status}) for {tuple(rows.shape)}")
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.out_features)


class Int8Linear(nn.Module):
    """`x @ W.T + bias` with W kept as per-channel int8 (W8A8, see the module docstring).

    `smooth` [in] (optional, float32): SmoothQuant factors, x * smooth is what gets
    quantized and the weight given must already be quantized as W / smooth
    (`quantize_weight(W, smooth)`); they move activation outliers into the weights.
    `kernel` (one of KERNELS; default `default_kernel(device)`) decides how it runs: on
    CPU the weight is packed once, for cpu_int8.c (in the layout of the loaded kernels'
    instruction set) or for oneDNN, and the plain int8 copy dropped; elsewhere the
    reference runs on the plain copy.
    """

    def __init__(
        self,
        qweight: Tensor,
        scales: Tensor,
        bias: Tensor | None = None,
        smooth: Tensor | None = None,
        kernel: str | None = None,
    ) -> None:
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(
                f"expected an int8 weight [out, in], got {qweight.dtype} {qweight.shape}"
            )
        if scales.shape != (qweight.shape[0],):
            raise ValueError(f"expected {qweight.shape[0]} scales, got shape {tuple(scales.shape)}")
        if smooth is not None and smooth.shape != (qweight.shape[1],):
            raise ValueError(
                f"expected {qweight.shape[1]} smoothing factors, got shape {tuple(smooth.shape)}"
            )
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.scales = scales.float()
        self.smooth = None if smooth is None else smooth.float().contiguous()
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        kernel = kernel or default_kernel(qweight.device, qweight.shape[1])
        if kernel not in KERNELS:
            raise ValueError(f"unknown int8 kernel {kernel!r}; use one of {', '.join(KERNELS)}")
        isa = cpu_kernel_isa() if kernel == "cpu" else None
        if kernel == "cpu" and isa is None:
            raise ValueError("the cpu int8 kernel is not available here (no C kernels)")
        if kernel == "cpu" and qweight.shape[1] > MAX_IN_FEATURES:
            raise ValueError(
                f"the cpu int8 kernel sums at most {MAX_IN_FEATURES} inputs in int32, "
                f"got {qweight.shape[1]}"
            )
        self.kernel = kernel
        self.packed_int8 = None if isa is None else pack_int8(qweight, self.scales, bias, isa)
        self.packed = pack(qweight) if kernel == "onednn" else None
        if kernel == "onednn" and self.packed is None:
            raise ValueError("the onednn int8 kernel is not available here")
        self.qweight = qweight if kernel == "reference" else None
        self.zero_points = (
            torch.zeros(qweight.shape[0], dtype=torch.int32) if kernel == "onednn" else None
        )

    @property
    def weight(self) -> Tensor:
        """The dequantized weight [out, in] in float32 (a copy), smoothing undone."""
        if self.packed_int8 is not None:
            qweight = unpack_int8(self.packed_int8)
        elif self.packed is not None:
            assert self.zero_points is not None
            # Unpacking goes through the GEMM itself: identity rows give back q_w.T.
            eye = torch.eye(self.in_features) * INT8_MAX
            qweight = packed_int8_linear(eye, self.packed, self.scales, self.zero_points).t()
            qweight = qweight / self.scales[:, None] / INT8_MAX
        else:
            assert self.qweight is not None
            qweight = self.qweight
        weight = qweight.float() * self.scales[:, None]
        return weight if self.smooth is None else weight * self.smooth

    def forward(self, x: Tensor) -> Tensor:
        if not x.numel():
            return x.new_empty(*x.shape[:-1], self.out_features)
        if self.packed_int8 is not None:
            return cpu_int8_linear(x, self.packed_int8, self.smooth)
        if self.packed is not None:
            assert self.zero_points is not None
            return packed_int8_linear(
                x, self.packed, self.scales, self.zero_points, self.bias, self.smooth
            )
        assert self.qweight is not None
        return reference_int8_linear(x, self.qweight, self.scales, self.bias, self.smooth)
