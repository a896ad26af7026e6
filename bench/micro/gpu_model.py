"""The random-weight Llama that bench/micro/gpu_kernels.py times, and its HBM roofline arithmetic.

`ModelShape` names a Llama's dimensions (`SHAPES`: the 8B and a seconds-on-CPU tiny one);
`build_model` makes the native model of a shape from `RandomWeights` on the device (no
file, no download); `decode_bytes` / `decode_roofline_ms` / `prefill_flops` say what a
step must cost at least, against the GPU's bandwidth from `bandwidth_for`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from textgate.kernels import get_attention_backend
from textgate.quantization.registry import get_weights_loader
from textgate.quantization.weights import Shard, Weights

# Peak HBM bandwidth in GB/s from the vendors' datasheets, matched in order against
# torch.cuda.get_device_name (more specific names first).
KNOWN_BANDWIDTH_GBS = (
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM5, "NVIDIA H100 80GB HBM3"
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),  # 40 GB parts
    ("L40S", 864.0),
    ("L4", 300.0),
)


@dataclass(frozen=True)
class ModelShape:
    """A Llama's dimensions (what the step's cost depends on)."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    def config(self) -> dict[str, Any]:
        """An HF-style config.json for it."""
        return {
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
        }

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor's name and shape."""
        kv = self.num_kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab, self.hidden),
            "model.norm.weight": (self.hidden,),
            "lm_head.weight": (self.vocab, self.hidden),
        }
        for i in range(self.num_layers):
            p = f"model.layers.{i}"
            shapes |= {
                f"{p}.input_layernorm.weight": (self.hidden,),
                f"{p}.post_attention_layernorm.weight": (self.hidden,),
                f"{p}.self_attn.q_proj.weight": (self.hidden, self.hidden),
                f"{p}.self_attn.k_proj.weight": (kv, self.hidden),
                f"{p}.self_attn.v_proj.weight": (kv, self.hidden),
                f"{p}.self_attn.o_proj.weight": (self.hidden, self.hidden),
                f"{p}.mlp.gate_proj.weight": (self.intermediate, self.hidden),
                f"{p}.mlp.up_proj.weight": (self.intermediate, self.hidden),
                f"{p}.mlp.down_proj.weight": (self.hidden, self.intermediate),
            }
        return shapes

    def linear_params(self) -> int:
        """Weights every decode step multiplies by: all projections and the lm head."""
        kv = self.num_kv_heads * self.head_dim
        per_layer = 2 * self.hidden * self.hidden + 2 * kv * self.hidden
        per_layer += 3 * self.intermediate * self.hidden
        return self.num_layers * per_layer + self.vocab * self.hidden

    def kv_bytes_per_token(self, element_size: int) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


SHAPES = {
    "8b": ModelShape("8b", 32, 4096, 32, 8, 14336, 128256),
    "tiny": ModelShape("tiny", 2, 128, 4, 2, 256, 512, 2048),
}
SHAPE_DEFAULTS = {"8b": {"context": 1024, "prefill": 2048}, "tiny": {"context": 64, "prefill": 256}}


class RandomWeights(Weights):
    """A checkpoint of random tensors made on the device as they are read (no file).

    Norm weights are ones, everything else N(0, 0.02²): the activations stay finite
    through every layer, as in a trained model.
    """

    def __init__(
        self, shapes: dict[str, tuple[int, ...]], device: torch.device, dtype: torch.dtype
    ):
        self.device, self.dtype = device, dtype
        self.process_group = None
        self.aliases = {}
        self.loader = get_weights_loader(None)
        self._routing = dict.fromkeys(shapes, "random")
        self._handles = {}
        self._shapes = shapes
        self._generator = torch.Generator(device).manual_seed(0)

    def get_shape(self, name: str) -> list[int]:
        return list(self._shapes[name])

    def get_tensor(self, name: str, *, to_dtype: bool = True) -> torch.Tensor:
        return self._make(name, self._shapes[name])

    def get_partial(
        self, name: str, dim: int, shard: Shard, *, to_dtype: bool = True
    ) -> torch.Tensor:
        shape = list(self._shapes[name])
        shape[dim] = shard.stop - shard.start
        return self._make(name, tuple(shape))

    def _make(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if "norm" in name:
            return torch.ones(shape, device=self.device, dtype=self.dtype)
        out = torch.empty(shape, device=self.device, dtype=self.dtype)
        return out.normal_(0.0, 0.02, generator=self._generator)


def build_model(shape: ModelShape, device: torch.device, dtype: torch.dtype) -> Any:
    """The native Llama of `shape` with random weights on `device`."""
    from textgate.shard_server.models.llama import LlamaForCausalLM

    weights = RandomWeights(shape.tensor_shapes(), device, dtype)
    return LlamaForCausalLM(shape.config(), weights, get_attention_backend("torch"))


def bandwidth_for(device: torch.device, flag: float | None) -> tuple[float | None, str]:
    """(GB/s, where the figure came from): the flag, the datasheet table, or none."""
    if flag is not None:
        return flag, "--bandwidth-gbs"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, gbs in KNOWN_BANDWIDTH_GBS:
            if key in name:
                return gbs, f"datasheet ({key})"
    return None, "unknown (pass --bandwidth-gbs)"


def decode_bytes(shape: ModelShape, batch: int, context: int, element_size: int) -> int:
    """Bytes a decode step must move at least: every linear weight once, the batch's
    embedding rows, and its KV context read plus the new tokens' KV written."""
    weights = (shape.linear_params() + batch * shape.hidden) * element_size
    return weights + batch * (context + 1) * shape.kv_bytes_per_token(element_size)


def decode_roofline_ms(
    shape: ModelShape, batch: int, context: int, element_size: int, bandwidth_gbs: float
) -> float:
    """Milliseconds a decode step takes that only streams `decode_bytes` at the bandwidth."""
    return decode_bytes(shape, batch, context, element_size) / (bandwidth_gbs * 1e9) * 1e3


def prefill_flops(shape: ModelShape, tokens: int) -> float:
    """Multiply-adds ×2 of a causal prefill: the linears, then QKᵀ and PV over half of T²."""
    return 2.0 * shape.linear_params() * tokens + 2.0 * shape.num_layers * shape.hidden * tokens**2
