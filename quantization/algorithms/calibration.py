"""The texts shipped for quantization: calibration samples and a held-out evaluation text.

Both are public-domain prose from Project Gutenberg (see `quantization/data/SOURCES.md`):
calibration is from Conan Doyle's *The Adventures of Sherlock Holmes*, the held-out text
from William Morris's *News from Nowhere*, so a perplexity measured on the held-out text
never sees what the quantizer was tuned on.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


def data_file(name: str) -> Path:
    """A file under `textgate/quantization/data/` (shipped as package data)."""
    return Path(str(resources.files("textgate.quantization").joinpath("data", name)))


def calibration_text_path() -> Path:
    """The default calibration text."""
    return data_file("calibration.txt")


def heldout_text_path() -> Path:
    """The held-out evaluation text (different content from the calibration text)."""
    return data_file("heldout.txt")


def read_text(path: str | Path) -> str:
    """A UTF-8 text file, refused with a clear error when missing or empty."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"text file {path} is empty")
    return text


def calibration_samples(tokenizer: Any, text: str, num_samples: int, seq_len: int) -> Tensor:
    """`num_samples` windows of `seq_len` tokens [num_samples, seq_len] from `text`.

    Windows start at evenly spaced offsets, so they cover the whole text and overlap only
    when the text is shorter than num_samples × seq_len tokens. Deterministic.
    """
    if num_samples < 1 or seq_len < 2:
        raise ValueError(f"need num_samples >= 1 and seq_len >= 2, got {num_samples}, {seq_len}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < seq_len:
        raise ValueError(
            f"the calibration text has {len(ids)} tokens, fewer than --seq-len {seq_len}"
        )
    tokens = torch.tensor(ids, dtype=torch.long)
    starts = torch.linspace(0, len(ids) - seq_len, num_samples).round().long()
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


def evaluation_windows(tokenizer: Any, text: str, window: int) -> Tensor:
    """The text's tokens cut into consecutive, non-overlapping windows [n, window] (tail dropped)."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    count = len(ids) // window
    if count == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {window}")
    return torch.tensor(ids[: count * window], dtype=torch.long).view(count, window)
