"""textgate.shard_server.models: native model implementations, looked up by `model_type`.

Importing the package registers every built-in model.
"""

from textgate.shard_server.models import gemma as _gemma  # noqa: F401  (registers models)
from textgate.shard_server.models import llama as _llama  # noqa: F401  (registers models)
from textgate.shard_server.models.config import ModelConfig
from textgate.shard_server.models.llama import LlamaForCausalLM
from textgate.shard_server.models.loader import load_model
from textgate.shard_server.models.registry import (
    UnsupportedModelError,
    get_model_class,
    register,
    supported_model_types,
)

__all__ = [
    "LlamaForCausalLM",
    "ModelConfig",
    "UnsupportedModelError",
    "get_model_class",
    "load_model",
    "register",
    "supported_model_types",
]
