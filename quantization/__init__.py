"""textgate.quantization: how checkpoint tensors are read, sharded and turned into layers.

Importing the package registers every built-in loader.
"""

from textgate.quantization import awq as _awq  # noqa: F401  (registers loaders)
from textgate.quantization import bitsandbytes as _bitsandbytes  # noqa: F401  (registers loaders)
from textgate.quantization import gguf as _gguf  # noqa: F401  (registers loaders)
from textgate.quantization import gptq as _gptq  # noqa: F401  (registers loaders)
from textgate.quantization import int8 as _int8  # noqa: F401  (registers loaders)
from textgate.quantization import unquantized as _unquantized  # noqa: F401  (registers loaders)
from textgate.quantization.base import Weight, WeightsLoader
from textgate.quantization.registry import (
    UnsupportedQuantizationError,
    get_weights_loader,
    register,
    registered_methods,
)
from textgate.quantization.weights import Shard, Weights

__all__ = [
    "Shard",
    "UnsupportedQuantizationError",
    "Weight",
    "Weights",
    "WeightsLoader",
    "get_weights_loader",
    "register",
    "registered_methods",
]
