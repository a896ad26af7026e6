"""The model names a request may give: the served model's, or a LoRA adapter's (vLLM's
convention: the adapter is chosen by `model`); any other is a 404."""

from __future__ import annotations

from collections.abc import Sequence

from textgate.router.generation.schemas import GenerateParameters
from textgate.router.http.errors import ModelNotFoundError

# Names every client may send for the one served model: TGI's README and clients use
# "tgi"; huggingface_hub's InferenceClient sends "dummy" when given a server URL; an empty
# or absent `model` is accepted as OpenAI-style servers do.
MODEL_ALIASES = frozenset({"", "tgi", "dummy"})


def served_model(requested: str, model_id: str, adapters: Sequence[str] = ()) -> str:
    """The served model's name for a request's `model`, or the LoRA adapter it names;
    ModelNotFoundError for any other.

    A path-like id (`HuggingFaceTB/SmolLM2-135M-Instruct`, a local folder) is also
    accepted by its last part, as `/v1/models` clients often shorten it.
    """
    if requested in MODEL_ALIASES or requested in (model_id, model_id.rstrip("/").split("/")[-1]):
        return model_id
    if requested in adapters:
        return requested
    also = f", the adapters {', '.join(adapters)}" if adapters else ""
    raise ModelNotFoundError(
        f"The model `{requested}` does not exist: this server serves `{model_id}` "
        f"(also accepted: `tgi`, huggingface_hub's `dummy`, or no `model`{also})"
    )


def with_adapter(
    model: str, adapters: Sequence[str], params: GenerateParameters
) -> GenerateParameters:
    """`params` running on the adapter `model` names (as served_model resolved it), if any."""
    return params.model_copy(update={"adapter_id": model}) if model in adapters else params
