"""Write a quantized model as GPTQ's or AutoAWQ's standard checkpoint folder.

GPTQ (rtn and gptq): `qweight/qzeros/scales/g_idx` per linear (v1 zero convention),
`quantize_config.json` as AutoGPTQ/GPTQModel write it and the same settings under
`config.json:quantization_config` (quant_method "gptq") as transformers reads them.
AWQ: AutoAWQ's GEMM tensors, `quant_config.json`, and `quantization_config` with
quant_method "awq", version "gemm", zero_point true. Every other tensor (embeddings,
norms, an untied lm_head) is stored in float16, as those tools store it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from textgate.kernels.packing import GPTQ_V1, UnpackedWeight, pack_awq, pack_gptq

if TYPE_CHECKING:
    from textgate.quantization.algorithms.quantize import QuantizeOptions

_QUANTIZER = "textgate"
# Files of the source folder that the quantized checkpoint replaces rather than copies.
_REPLACED = {"config.json", "model.safetensors.index.json", ".textgate-converted"}
_FLOAT_DTYPE = torch.float16


def quantization_config(options: QuantizeOptions) -> dict[str, Any]:
    """`config.json:quantization_config` for these options (transformers' field names)."""
    spec = options.spec
    if options.method == "awq":
        return {
            "quant_method": "awq",
            "bits": spec.bits,
            "group_size": spec.group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    return {
        "quant_method": "gptq",
        "bits": spec.bits,
        "group_size": spec.group_size,
        "desc_act": options.desc_act,
        "sym": spec.sym,
        "damp_percent": options.percdamp,
        "true_sequential": False,
        "static_groups": False,
        "checkpoint_format": GPTQ_V1,
        "meta": {"quantizer": [f"{_QUANTIZER}:{options.method}"]},
    }


def _tool_config(options: QuantizeOptions) -> tuple[str, dict[str, Any]]:
    """The method's own config file: AutoGPTQ's quantize_config.json or AutoAWQ's quant_config.json."""
    spec = options.spec
    if options.method == "awq":
        return "quant_config.json", {
            "zero_point": True,
            "q_group_size": spec.group_size,
            "w_bit": spec.bits,
            "version": "GEMM",
        }
    return "quantize_config.json", {
        **quantization_config(options),
        "model_name_or_path": None,
        "model_file_base_name": "model",
    }


def pack(weight: UnpackedWeight, options: QuantizeOptions) -> dict[str, Tensor]:
    """One linear's checkpoint tensors in the method's layout."""
    if options.method == "awq":
        return pack_awq(weight.intweight, weight.scales, weight.zeros)
    return pack_gptq(
        weight.intweight,
        weight.scales,
        weight.zeros,
        weight.g_idx,
        options.spec.bits,
        checkpoint_format=GPTQ_V1,
    )


def checkpoint_tensors(
    model: nn.Module, quantized: Mapping[str, UnpackedWeight], options: QuantizeOptions
) -> dict[str, Tensor]:
    """Every tensor of the quantized checkpoint by name."""
    from transformers.core_model_loading import revert_weight_conversion

    # The names save_pretrained writes, which `quantized` uses and loaders read: transformers
    # 5 renames and fuses some tensors in memory (a MoE block's experts into 3D tensors),
    # and this is the inverse it saves through.
    state = revert_weight_conversion(model, model.state_dict())
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: the embedding is the head
    tensors: dict[str, Tensor] = {}
    for name, tensor in state.items():
        prefix = name.removesuffix(".weight")
        if prefix in quantized and name.endswith(".weight"):
            for suffix, packed in pack(quantized[prefix], options).items():
                tensors[f"{prefix}.{suffix}"] = packed
        elif tensor.is_floating_point():
            tensors[name] = tensor.detach().to(_FLOAT_DTYPE).contiguous()
        else:
            tensors[name] = tensor.detach().contiguous()
    missing = set(quantized) - {n.rsplit(".", 1)[0] for n in tensors if n.endswith(".scales")}
    if missing:
        raise ValueError(f"quantized layers missing from the model: {sorted(missing)}")
    return tensors


def write_checkpoint(
    source: Path,
    output: Path,
    model: nn.Module,
    quantized: Mapping[str, UnpackedWeight],
    options: QuantizeOptions,
) -> None:
    """Write the checkpoint folder atomically: a failure leaves no half-written `output`."""
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}-", dir=output.parent))
    try:
        for item in source.iterdir():
            if item.is_file() and item.suffix != ".safetensors" and item.name not in _REPLACED:
                shutil.copy2(item, tmp / item.name)
        save_file(
            checkpoint_tensors(model, quantized, options),
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
        config = json.loads((source / "config.json").read_text())
        config["quantization_config"] = quantization_config(options)
        config["dtype"] = "float16"
        config.pop("torch_dtype", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        name, tool_config = _tool_config(options)
        (tmp / name).write_text(json.dumps(tool_config, indent=2) + "\n")
        if output.exists():
            output.rmdir()  # checked empty by the caller
        tmp.rename(output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
