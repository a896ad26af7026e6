from __future__ import annotations

import pytest

from textgate.quantization import (
    UnsupportedQuantizationError,
    WeightsLoader,
    get_weights_loader,
    register,
    registered_methods,
)
from textgate.quantization.unquantized import UnquantizedWeightsLoader


def test_no_method_means_unquantized():
    assert isinstance(get_weights_loader(None), UnquantizedWeightsLoader)
    assert isinstance(get_weights_loader("unquantized", {}), UnquantizedWeightsLoader)
    assert "unquantized" in registered_methods()


def test_unknown_method_is_a_clear_error():
    with pytest.raises(UnsupportedQuantizationError, match="'exl9' is not supported; known"):
        get_weights_loader("exl9")


def test_registered_loader_is_built_from_the_quantization_config(monkeypatch):
    from textgate.quantization import registry

    monkeypatch.setattr(registry, "_LOADERS", registry._LOADERS.copy())

    @register("fake-gptq", "fake-gptq-alias")
    class FakeLoader(UnquantizedWeightsLoader):
        def __init__(self, bits: int = 16) -> None:
            self.bits = bits

        @classmethod
        def from_config(cls, quantization_config) -> WeightsLoader:
            return cls(quantization_config["bits"])

    loader = get_weights_loader("fake-gptq-alias", {"bits": 4})
    assert isinstance(loader, FakeLoader)
    assert loader.bits == 4
    with pytest.raises(ValueError, match="already registered"):
        register("fake-gptq")(FakeLoader)
