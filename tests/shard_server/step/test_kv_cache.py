from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from textgate.kernels import SdpaAttentionBackend, cpu_attention, cpu_build, cpu_layers, kv_quant
from textgate.proto import generate_pb2 as pb
from textgate.shard_server.loading.shard_loader import load_model as load_shard_model
from textgate.shard_server.models import load_model
from textgate.shard_server.protocols.paged_model import CacheConfig, PagedModel
from textgate.shard_server.step.kv_cache import KVCache
from textgate.tests.shard_server.models.conftest import PagedRunner, build_tiny


def _cache(**overrides) -> KVCache:
    args = dict(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=3, head_dim=5)
    return KVCache.allocate(**{**args, **overrides}, dtype=torch.float32)


def test_allocates_zeroed_paged_layout():
    cache = _cache()
    assert (cache.num_layers, cache.num_blocks, cache.num_slots) == (2, 6, 24)
    assert cache.key_caches[1].shape == (6, 4, 3, 5)
    assert all(not t.any() for t in cache.key_caches + cache.value_caches)


def test_store_writes_slot_block_and_offset():
    cache = _cache()
    key, value = torch.randn(3, 3, 5), torch.randn(3, 3, 5)
    cache.store(1, key, value, torch.tensor([0, 9, 23]))  # (0, 0), (2, 1), (5, 3)
    key_cache, value_cache = cache.layer(1)
    torch.testing.assert_close(key_cache[0, 0], key[0])
    torch.testing.assert_close(key_cache[2, 1], key[1])
    torch.testing.assert_close(value_cache[5, 3], value[2])
    assert not cache.key_caches[0].any()
    assert int((key_cache != 0).any(-1).any(-1).sum()) == 3


def test_store_casts_to_the_cache_dtype():
    cache = _cache(num_layers=1)
    cache.key_caches[0] = cache.key_caches[0].bfloat16()
    cache.value_caches[0] = cache.value_caches[0].bfloat16()
    cache.store(0, torch.ones(1, 3, 5), torch.ones(1, 3, 5), torch.tensor([4], dtype=torch.int32))
    assert cache.key_caches[0][1, 0].eq(1).all()


def test_bytes_per_block_counts_keys_and_values_of_all_layers():
    size = KVCache.bytes_per_block(
        num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16
    )
    assert size == 2 * 30 * 16 * 3 * 64 * 2


# -- quantized caches (--kv-cache-dtype int8 / fp8) ---------------------------------------

QUANTIZED = [torch.int8, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_quantized_cache_holds_scales_and_stores_quantized(dtype):
    cache = KVCache.allocate(
        num_layers=2, num_blocks=6, block_size=4, num_kv_heads=3, head_dim=5, dtype=dtype
    )
    assert cache.quantized and cache.dtype == dtype
    assert cache.key_caches[1].shape == (6, 4, 3, 5) and cache.key_caches[1].dtype == dtype
    key_scales, value_scales = cache.layer_scales(1)
    assert key_scales is not None and value_scales is not None
    assert key_scales.shape == value_scales.shape == (6, 4, 3)
    assert key_scales.dtype == torch.float32
    key, value = torch.randn(3, 3, 5), torch.randn(3, 3, 5) * 100
    cache.store(1, key, value, torch.tensor([0, 9, 23]))  # (0, 0), (2, 1), (5, 3)
    key_cache, value_cache = cache.layer(1)
    step = 0.5 / 127 if dtype == torch.int8 else 1 / 16  # half a step, relative to absmax
    for (block, offset), row in zip([(0, 0), (2, 1), (5, 3)], range(3), strict=True):
        back = kv_quant.dequantize_kv(
            value_cache[block, offset], value_scales[block, offset], torch.float32
        )
        bound = value[row].abs().amax(-1, keepdim=True) * step
        assert ((back - value[row]).abs() <= bound + 1e-6).all()
    torch.testing.assert_close(
        kv_quant.dequantize_kv(key_cache[2, 1], key_scales[2, 1], torch.float32),
        key[1],
        atol=0.07 * float(key[1].abs().max()),
        rtol=0,
    )
    assert not cache.key_scales[0].any() and int((key_scales != 0).any(-1).sum()) == 3


def test_unquantized_cache_has_no_scales():
    cache = _cache()
    assert not cache.quantized and cache.layer_scales(0) == (None, None)


@pytest.mark.parametrize(("model_dtype", "ratio"), [(torch.bfloat16, 2), (torch.float32, 4)])
@pytest.mark.parametrize("dtype", QUANTIZED)
def test_a_quantized_block_takes_about_half_of_bf16(model_dtype, ratio, dtype):
    shape = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64)
    quantized = KVCache.bytes_per_block(**shape, dtype=dtype)
    assert quantized == 2 * 30 * 16 * 3 * (64 + 4)  # one byte per element, a float32 scale
    full = KVCache.bytes_per_block(**shape, dtype=model_dtype)
    # The scales cost 4 bytes in 68: the same memory holds 1.88x (3.76x) the blocks.
    assert 0.9 * ratio < full / quantized < ratio


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny(path, "llama", num_hidden_layers=3)
    return path


@dataclass
class FakeQuantizedCache(KVCache):
    """A float cache storing the quantize→dequantize round trip of every token: what the
    quantized cache should compute, through the unquantized code path."""

    round_trip: torch.dtype = torch.int8

    def store(self, layer, key, value, slot_mapping):
        key, value = (
            kv_quant.dequantize_kv(*kv_quant.quantize_kv(x, self.round_trip), x.dtype)
            for x in (key, value)
        )
        super().store(layer, key, value, slot_mapping)


def _generate(model, kv_dtype, prompt, fake: bool = False, steps: int = 6) -> torch.Tensor:
    """Logits [len(prompt) + steps, V]: a prompt in two chunks, then greedy decodes,
    beside a second sequence (ragged batch), in a cache of elements `kv_dtype` (fake: a
    float32 cache of its round trip)."""
    model.set_kv_cache_dtype(torch.float32 if fake else kv_dtype)
    runner = PagedRunner(model, num_blocks=40, block_size=4)
    if fake:
        runner.cache = FakeQuantizedCache(
            runner.cache.key_caches, runner.cache.value_caches, 4, round_trip=kv_dtype
        )
    else:
        assert runner.cache.dtype == kv_dtype
    half = len(prompt) // 2
    with pytest.MonkeyPatch.context() as patch:
        if fake:  # the fused C store, in the layers or the one-call stack, would write the
            # float cache directly
            patch.setattr(cpu_layers, "rotary_and_store", lambda *args: None)
            patch.setattr(model, "use_decoder_stack", False)
        outputs = [runner.step({0: prompt[:half], 1: prompt[:3]}, all_logits=True)[0]]
        outputs.append(runner.step({0: prompt[half:], 1: prompt[3:9]}, all_logits=True)[0])
        token = int(outputs[-1][-1].argmax())
        for _ in range(steps):
            outputs.append(runner.step({0: [token], 1: [1]}, all_logits=True)[0])
            token = int(outputs[-1][-1].argmax())
    return torch.cat(outputs)


@pytest.mark.parametrize("kernels", ["cpu", "pytorch"])
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_model_logits_with_a_quantized_cache(tiny_llama, kv_dtype, kernels, monkeypatch):
    """fp32 weights. Exact: the quantized cache computes what a float cache holding the
    dequantized K/V computes. Accuracy (a random 3-layer model with large weights, so
    errors grow): logits within 2.5% (int8) / 10% (fp8) of their spread on average, 15% /
    60% at worst, the same greedy tokens. On the C kernels and on the PyTorch references."""
    if kernels == "pytorch":
        monkeypatch.setattr(cpu_build, "load_library", lambda: None)
    fused = []  # whether each layer's rotary + quantized store ran in C
    rotary_and_store = cpu_attention.rotary_and_store_quantized

    def spy(*args):
        query = rotary_and_store(*args)
        fused.append(query is not None)
        return query

    monkeypatch.setattr(cpu_attention, "rotary_and_store_quantized", spy)
    model = load_model(tiny_llama, torch.float32, "cpu")
    prompt = torch.randint(0, 101, (22,), generator=torch.Generator().manual_seed(3)).tolist()
    quantized = _generate(model, kv_dtype, prompt)
    assert fused and set(fused) == {kernels == "cpu"}
    torch.testing.assert_close(
        quantized, _generate(model, kv_dtype, prompt, fake=True), atol=1e-4, rtol=1e-4
    )
    reference = _generate(model, torch.float32, prompt)
    error = (quantized - reference).abs() / float(reference.std())
    mean_bound, max_bound = (0.025, 0.15) if kv_dtype == torch.int8 else (0.1, 0.6)
    assert float(error.mean()) < mean_bound and float(error.max()) < max_bound
    assert torch.equal(quantized.argmax(-1), reference.argmax(-1))


def test_a_backend_that_cannot_read_quantized_kv_is_refused(tiny_llama):
    class FloatOnly(SdpaAttentionBackend):
        supports_quantized_kv = False

    model = load_model(tiny_llama, torch.float32, "cpu")
    model.attention_backend = FloatOnly()
    model.set_kv_cache_dtype(torch.float32)
    with pytest.raises(ValueError, match="FloatOnly cannot read a fp8_e4m3 KV cache"):
        model.set_kv_cache_dtype(torch.float8_e4m3fn)


# -- the shard: --kv-cache-dtype from CacheConfig to the allocated cache -------------------


def test_cache_config_rejects_unknown_kv_dtypes():
    with pytest.raises(ValueError, match=r"unknown KV cache dtype 'fp4'; expected one of: auto"):
        CacheConfig(kv_cache_dtype="fp4")


def _paged(path, kv_cache_dtype: str) -> PagedModel:
    config = CacheConfig(block_size=4, kv_cache_memory=1 << 20, kv_cache_dtype=kv_cache_dtype)
    model = load_shard_model(path, "tiny", "bfloat16", cache_config=config)
    assert isinstance(model, PagedModel)
    return model


def test_the_shard_allocates_and_serves_a_quantized_cache(tiny_model_dir):
    """The same memory holds 2D / (D + 4) times the blocks of a bf16 cache (1.88x at head
    size 64; the float32 scales weigh more in this tiny model); a warmed-up shard runs."""
    auto, int8 = _paged(tiny_model_dir, "auto"), _paged(tiny_model_dir, "int8")
    dim = auto.model.head_dim
    assert int8.num_blocks() / auto.num_blocks() == pytest.approx(2 * dim / (dim + 4), rel=1e-3)
    warm = int8.warmup(pb.WarmupRequest(max_prefill_tokens=16))
    assert int8.kv_cache is not None and int8.kv_cache.dtype == torch.int8
    assert warm.num_blocks == int8.num_blocks()
    fp8 = _paged(tiny_model_dir, "fp8")
    assert fp8.model.kv_cache_dtype == torch.float8_e4m3fn


def test_transformers_modules_on_the_paged_engine_get_a_quantized_cache(tiny_model_dir):
    config = CacheConfig(block_size=4, kv_cache_memory=1 << 20, kv_cache_dtype="int8")
    model = load_shard_model(tiny_model_dir, "tiny", "float32", cache_config=config, native=False)
    assert type(model.model).__name__ == "TransformersPagedModel"
    model.warmup(pb.WarmupRequest(max_prefill_tokens=16))
    assert model.kv_cache is not None and model.kv_cache.dtype == torch.int8


def test_info_reports_the_kv_dtype_and_bytes_per_token(tiny_model_dir):
    from textgate.router.config import RouterConfig
    from textgate.router.server import limits_line
    from textgate.router.tgi.routes import info_response

    model = _paged(tiny_model_dir, "fp8")
    info = model.describe()
    layers, heads, dim = model.model.num_layers, model.model.num_kv_heads, model.model.head_dim
    assert info.kv_cache_dtype == "fp8_e4m3"
    assert info.kv_cache_bytes_per_token == 2 * layers * heads * (dim + 4)
    assert _paged(tiny_model_dir, "auto").describe().kv_cache_dtype == "bfloat16"
    config = RouterConfig(
        model_id="m",
        tokenizer_path="t",
        max_input_tokens=32,
        max_total_tokens=64,
        max_batch_prefill_tokens=64,
        max_batch_total_tokens=256,
    )
    body = info_response(config, info)
    assert body.kv_cache_dtype == "fp8_e4m3"
    assert body.kv_cache_bytes_per_token == info.kv_cache_bytes_per_token
    line = limits_line(config, info, pb.WarmupResponse(num_blocks=10))
    assert (
        f"kv_cache=10 blocks x 4 tokens (fp8_e4m3, {2 * layers * heads * (dim + 4)} bytes" in line
    )
