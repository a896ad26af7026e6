"""`python -m textgate.bench.model_tools.twin SRC DST`: a model folder shaped like SRC, with random weights.

A benchmark's speed does not depend on the weights' values (`textgate-bench` sends
`ignore_eos`, so every request generates its full length): a twin of the embedded default
model made from its config and tokenizer (~4 MB) times the same as the model itself, and
travels where the model cannot (a device machine lent without network or room for the
94 MB weights; bench/gpu_check.sh). `--tiny` keeps the tokenizer but shrinks the layers
to seconds-on-CPU size, for the dry run of that script.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

# Everything of a model folder except its weights (the converted default model's files).
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def copy_model_files(src: Path, dst: Path) -> list[str]:
    """Copy SRC's config and tokenizer files into DST; the names copied (config.json must be)."""
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} has no config.json")
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in MODEL_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def make_twin(src: Path, dst: Path, *, tiny: bool = False, seed: int = 0) -> Path:
    """DST: SRC's config and tokenizer with random float32 weights of that config (or of
    TINY layers over the same vocabulary)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    copy_model_files(src, dst)
    if tiny:
        config_path = dst / "config.json"
        config = json.loads(config_path.read_text())
        config.update(TINY)
        config_path.write_text(json.dumps(config, indent=2) + "\n")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(dst))
    model.save_pretrained(dst)
    return dst


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m textgate.bench.model_tools.twin", description=__doc__
    )
    parser.add_argument("src", type=Path, help="a model folder (its weights are not read)")
    parser.add_argument("dst", type=Path)
    parser.add_argument("--tiny", action="store_true", help="2 small layers, same vocabulary")
    parser.add_argument("--copy-only", action="store_true", help="config and tokenizer only")
    args = parser.parse_args(argv)
    if args.copy_only:
        copy_model_files(args.src, args.dst)
    else:
        make_twin(args.src, args.dst, tiny=args.tiny)
    print(args.dst)


if __name__ == "__main__":
    main()
