from __future__ import annotations

import pytest

from textgate.shard_server.models import (
    LlamaForCausalLM,
    UnsupportedModelError,
    get_model_class,
    register,
    supported_model_types,
)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "phi3"])
def test_llama_family_is_native(model_type):
    assert get_model_class(model_type) is LlamaForCausalLM
    assert model_type in supported_model_types()


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_gemma_is_a_llama_subclass(model_type):
    assert issubclass(get_model_class(model_type), LlamaForCausalLM)


@pytest.mark.parametrize("model_type", ["gpt2", None])
def test_other_types_raise_a_clear_error(model_type):
    with pytest.raises(
        UnsupportedModelError,
        match="no native implementation; supported: gemma2, gemma3_text, llama",
    ):
        get_model_class(model_type)


def test_unsupported_model_error_is_a_value_error():
    assert issubclass(UnsupportedModelError, ValueError)


def test_a_type_registers_once():
    with pytest.raises(ValueError, match="'llama' is already registered"):
        register("llama")(LlamaForCausalLM)
