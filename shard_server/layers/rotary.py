"""Rotary position embeddings (RoPE) and the scaling variants Llama-family checkpoints use.

Supported `rope_type`s: default, linear, dynamic (NTK), llama3, yarn and longrope (Phi-3;
"su" is its older name), each over all of a head's dimensions or its leading fraction
(`partial_rotary_factor`). Parameters are read from `config.rope_parameters` (transformers
5) or `rope_theta` + `rope_scaling` (older checkpoints); both spell the same thing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

DEFAULT_THETA = 10000.0
# Types whose frequencies depend on each sequence's length, not only on the position.
_LENGTH_DEPENDENT = frozenset({"dynamic", "longrope"})
_ORIGINAL_CONTEXT = frozenset({"llama3", "yarn", "longrope"})
_ALIASES = {"su": "longrope"}


@dataclass(frozen=True)
class RopeConfig:
    """What a rotary embedding needs from a model config."""

    rope_type: str = "default"
    theta: float = DEFAULT_THETA
    #: The context length the scaling is relative to (config.max_position_embeddings).
    max_position_embeddings: int = 2048
    #: Type-specific keys (factor, low_freq_factor, original_max_position_embeddings, …).
    params: Mapping[str, Any] = field(default_factory=dict)
    #: The fraction of each head's dimensions that rotates (the first ones; Phi-4-mini's
    #: 0.75); the rest pass through.
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> RopeConfig:
        """Read RoPE settings from a config.json dict, in either transformers' spelling."""
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        if any(isinstance(value, Mapping) for value in rope.values()):
            raise ValueError("per-layer-type RoPE parameters are not supported for this model")
        partial = rope.pop("partial_rotary_factor", None)
        partial = float(partial or config.get("partial_rotary_factor") or 1.0)
        if not 0.0 < partial <= 1.0:
            raise ValueError(f"partial_rotary_factor={partial} must be in (0, 1]")
        max_positions = int(config.get("max_position_embeddings", 2048))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        rope_type = _ALIASES.get(rope_type, rope_type)
        theta = float(rope.pop("rope_theta", config.get("rope_theta", DEFAULT_THETA)))
        if rope_type in _ORIGINAL_CONTEXT:
            # transformers prefers a top-level original_max_position_embeddings (Phi-3
            # keeps the pretrained length there) over the one in the rope parameters.
            original = config.get("original_max_position_embeddings")
            if original is not None:
                rope["original_max_position_embeddings"] = original
            rope.setdefault("original_max_position_embeddings", max_positions)
        if rope_type not in _INV_FREQ:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported; supported: {', '.join(sorted(_INV_FREQ))}"
            )
        return cls(rope_type, theta, max_positions, rope, partial)


InvFreqFn = Callable[[RopeConfig, int], tuple[Tensor, float]]
_INV_FREQ: dict[str, InvFreqFn] = {}


def _rope_type(name: str) -> Callable[[InvFreqFn], InvFreqFn]:
    def wrap(fn: InvFreqFn) -> InvFreqFn:
        _INV_FREQ[name] = fn
        return fn

    return wrap


def _base_inv_freq(theta: float | Tensor, dim: int) -> Tensor:
    """1 / theta^(2i/dim) for i < dim/2, in float32; theta may be a column of per-row bases."""
    device = theta.device if isinstance(theta, Tensor) else None
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (theta**exponents)


@_rope_type("default")
def _default(cfg: RopeConfig, dim: int) -> tuple[Tensor, float]:
    return _base_inv_freq(cfg.theta, dim), 1.0


@_rope_type("linear")
def _linear(cfg: RopeConfig, dim: int) -> tuple[Tensor, float]:
    # Dividing the frequencies by `factor` is dividing the positions by it.
    return _base_inv_freq(cfg.theta, dim) / cfg.params["factor"], 1.0


@_rope_type("dynamic")
def _dynamic(cfg: RopeConfig, dim: int) -> tuple[Tensor, float]:
    # The base is rescaled per sequence at run time (see RotaryEmbedding.cos_sin).
    return _base_inv_freq(cfg.theta, dim), 1.0


@_rope_type("llama3")
def _llama3(cfg: RopeConfig, dim: int) -> tuple[Tensor, float]:
    inv_freq = _base_inv_freq(cfg.theta, dim)
    factor = cfg.params["factor"]
    low, high = cfg.params["low_freq_factor"], cfg.params["high_freq_factor"]
    old_context = cfg.params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between
    # them blended linearly in 1/wavelength.
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
    return torch.where(in_band, blended, scaled), 1.0


@_rope_type("yarn")
def _yarn(cfg: RopeConfig, dim: int) -> tuple[Tensor, float]:
    params = cfg.params
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or cfg.max_position_embeddings / original
    scaling = params.get("attention_factor")
    if scaling is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            scaling = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            scaling = _yarn_mscale(factor, 1.0)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1
    low, high = _yarn_correction_range(
        beta_fast, beta_slow, dim, cfg.theta, original, params.get("truncate", True)
    )
    pos_freqs = cfg.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - _linear_ramp(low, high, dim // 2)
    # Extrapolate (keep) the high-frequency dims, interpolate the low-frequency ones.
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(scaling)


@_rope_type("longrope")
def _longrope(cfg: RopeConfig, dim: int) -> tuple[Tensor, float]:
    # The short factors: what a sequence within the original context uses (the long ones
    # are RotaryEmbedding.long_inv_freq, chosen per sequence in cos_sin).
    return longrope_inv_freq(cfg, dim, "short_factor"), _longrope_scaling(cfg)


def longrope_inv_freq(cfg: RopeConfig, dim: int, which: str) -> Tensor:
    """LongRoPE's frequencies: the base ones, each divided by its `which` factor."""
    if which not in cfg.params:
        raise ValueError(f"longrope RoPE needs {which} in its rope parameters")
    factors = torch.tensor(cfg.params[which], dtype=torch.float32)
    if factors.shape != (dim // 2,):
        raise ValueError(f"longrope {which} has {len(factors)} entries, not head_dim/2={dim // 2}")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (factors * cfg.theta**exponents)


def _longrope_scaling(cfg: RopeConfig) -> float:
    """cos/sin scale: the configured attention_factor, else the paper's, from how far the
    context was extended (`factor`, else max_position_embeddings / original)."""
    params = cfg.params
    original = params["original_max_position_embeddings"]
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = params.get("factor") or cfg.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_range(
    fast: float, slow: float, dim: int, theta: float, context: int, truncate: bool
) -> tuple[float, float]:
    def dim_for(rotations: float) -> float:
        return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_for(fast), dim_for(slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _linear_ramp(low: float, high: float, size: int) -> Tensor:
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    return torch.clamp((torch.arange(size, dtype=torch.float32) - low) / (high - low), 0, 1)


class RotaryEmbedding(nn.Module):
    """Per-token cos/sin tables and their application to query/key heads."""

    def __init__(self, cfg: RopeConfig, head_dim: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.rotary_dim = int(head_dim * cfg.partial_rotary_factor)
        """The leading dimensions of a head that rotate: head_dim unless partial."""
        if self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor leaves {self.rotary_dim} rotary dims, an odd number"
            )
        inv_freq, self.attention_scaling = _INV_FREQ[cfg.rope_type](cfg, self.rotary_dim)
        self.inv_freq: Tensor
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        long_inv_freq = None
        if cfg.rope_type == "longrope":
            long_inv_freq = longrope_inv_freq(cfg, self.rotary_dim, "long_factor").to(device)
        self.long_inv_freq: Tensor | None
        """LongRoPE's frequencies for sequences past the original context; None otherwise."""
        self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)

    @property
    def needs_seq_lens(self) -> bool:
        """Dynamic NTK rescales by each sequence's length and LongRoPE picks its factors by
        it, so `cos_sin` needs it."""
        return self.cfg.rope_type in _LENGTH_DEPENDENT

    def cos_sin(
        self, positions: Tensor, dtype: torch.dtype, seq_lens: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """cos and sin [T, rotary_dim] for token positions [T].

        `seq_lens` [T] is the total length of each token's sequence; dynamic NTK needs
        it and uses the base a sequence of that length would use; LongRoPE uses its long
        factors for a sequence longer than the original context, as transformers does
        for the whole forward call (its max position + 1).
        """
        inv_freq = self.inv_freq[None, :]  # [1, rotary_dim/2]
        if self.needs_seq_lens:
            if seq_lens is None:
                raise ValueError(f"{self.cfg.rope_type} RoPE needs each token's sequence length")
            seq_lens = seq_lens.to(self.inv_freq.device)
            if self.long_inv_freq is not None:
                inv_freq = self._longrope_inv_freq(seq_lens, self.long_inv_freq)
            else:
                inv_freq = self._dynamic_inv_freq(seq_lens)  # [T, rotary_dim/2]
        freqs = positions.float()[:, None] * inv_freq  # [T, rotary_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, rotary_dim]
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def _longrope_inv_freq(self, seq_lens: Tensor, long_inv_freq: Tensor) -> Tensor:
        longer = seq_lens > self.cfg.params["original_max_position_embeddings"]  # [T]
        return torch.where(longer[:, None], long_inv_freq, self.inv_freq)  # [T, rotary_dim/2]

    def _dynamic_inv_freq(self, seq_lens: Tensor) -> Tensor:
        dim, factor = self.rotary_dim, self.cfg.params["factor"]
        max_positions = self.cfg.max_position_embeddings
        # Sequences within the trained context keep the original base.
        lengths = torch.clamp(seq_lens, min=max_positions)
        base = self.cfg.theta * ((factor * lengths / max_positions) - (factor - 1)) ** (
            dim / (dim - 2)
        )
        return _base_inv_freq(base[:, None], dim)  # [T, rotary_dim/2]


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) → (-x2, x1) over the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate heads x [T, H, head_dim] by per-token cos/sin [T, rotary_dim]; dimensions
    past rotary_dim pass through."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated = apply_rotary(x[..., :rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, head_dim]
    return x * cos + rotate_half(x) * sin


def signed_sin(sin: Tensor) -> Tensor:
    """sin [T, head_dim] with its first half negated, for `apply_rotary_signed`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def apply_rotary_signed(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """`apply_rotary(x, cos, sin)` given `sin_signed = signed_sin(sin)`, with the same result.

    rotate_half(x) * sin == x.roll(half) * sin_signed: one roll instead of chunk, neg and
    cat, in every layer of every step; the sign flip is paid once per step.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated = apply_rotary_signed(x[..., :rotary_dim], cos, sin_signed)
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
    half = x.shape[-1] // 2
    return x * cos[:, None, :] + x.roll(half, -1) * sin_signed[:, None, :]
