"""The model names a request may give for the one served model; any other is a 404."""

from __future__ import annotations

from textgate.router.http.errors import ModelNotFoundError

# Names every client may send for the one served model: TGI's README and clients use
# "tgi"; huggingface_hub's InferenceClient sends "dummy" when given a server URL; an empty
# or absent `model` is accepted as OpenAI-style servers do.
MODEL_ALIASES = frozenset({"", "tgi", "dummy"})


def served_model(requested: str, model_id: str) -> str:
    """The served model's name for a request's `model`; ModelNotFoundError for any other.

    A path-like id (`HuggingFaceTB/SmolLM2-135M-Instruct`, a local folder) is also
    accepted by its last part, as `/v1/models` clients often shorten it.
    """
    if requested in MODEL_ALIASES or requested in (model_id, model_id.rstrip("/").split("/")[-1]):
        return model_id
    raise ModelNotFoundError(
        f"The model `{requested}` does not exist: this server serves `{model_id}` "
        "(also accepted: `tgi`, huggingface_hub's `dummy`, or no `model`)"
    )
