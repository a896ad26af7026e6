"""End to end: `--quantize int8` and `--quantize gguf` serving the embedded default model over
the real HTTP routes; the bitsandbytes methods on the default model's weights, one shard in-process."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from textgate.kernels import AttentionMetadata
from textgate.kernels.cpu_isa import has_bf16_arithmetic
from textgate.quantization.resident import resident_bytes
from textgate.shard_server.models import load_model

# A question the default model answers with a wide margin (top-1 vs top-2 first token:
# 2.6 nats in fp32, 2.3 with int8): "What is the capital of France?" starts within 0.1 nat
# of an answer in French even in fp32, so any faithful quantization may flip it.
QUESTION = "In which city is the Eiffel Tower?"


@pytest.fixture(scope="module")
def chat_prompt(default_model_dir: Path) -> str:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    messages = [{"role": "user", "content": QUESTION}]
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


@pytest.fixture(scope="module")
def int8_server(tmp_path_factory: pytest.TempPathFactory, launch_server, default_model_dir):
    server = launch_server(
        # float32 activations: exact text is only stable there (bf16 flips this answer).
        tmp_path_factory.mktemp("int8"),
        "--quantize",
        "int8",
        "--dtype",
        "float32",
    )
    try:
        server.wait_ready()
        yield server.url
    finally:
        server.stop()


@pytest.mark.e2e
def test_int8_server_answers_and_reports_its_weights(int8_server: str, chat_prompt: str) -> None:
    info = httpx.get(f"{int8_server}/info").json()
    assert info["quantize"] == "int8"
    # 135M parameters: int8 linears and head (~134 MB) plus the float32 embedding (~113 MB);
    # unquantized float32 is ~650 MB.
    assert 200e6 < info["model_weight_bytes"] < 280e6
    body = {"inputs": chat_prompt, "parameters": {"max_new_tokens": 20}}
    response = httpx.post(f"{int8_server}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert "Paris" in response.json()["generated_text"]
    # OpenAI samples at temperature 1 by default: ask for greedy.
    chat = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 20, "temperature": 0}
    response = httpx.post(f"{int8_server}/v1/chat/completions", json=chat, timeout=120)
    assert "Paris" in response.json()["choices"][0]["message"]["content"]


@pytest.mark.e2e
def test_gguf_server_keeps_the_embedded_models_4_bit_layers(
    tmp_path_factory: pytest.TempPathFactory, launch_server, chat_prompt: str
) -> None:
    # `--dtype auto` serves gguf in bf16 (the int4 kernel's dtype) without timing float32
    # where the CPU has bf16 arithmetic; elsewhere it times both.
    server = launch_server(tmp_path_factory.mktemp("gguf"), "--quantize", "gguf")
    try:
        server.wait_ready()
        info = httpx.get(f"{server.url}/info").json()
        assert info["quantize"] == "gguf"
        choice = info["autoconfig"]["dtype"]
        if has_bf16_arithmetic():
            assert choice == {"value": "bfloat16", "source": "quantization", "trials": []}
        else:
            assert choice["source"] == "measured" and len(choice["trials"]) == 2
        assert info["model_dtype"] == choice["value"]
        if choice["value"] == "bfloat16":
            # The Q4_1 linears stay 4-bit: ~180 MB against the dense bf16 model's ~326 MB.
            assert info["model_weight_bytes"] < 200e6
        assert info["cpu_kernels"]["int4_layout"] != "unknown"
        body = {"inputs": chat_prompt, "parameters": {"max_new_tokens": 20}}
        response = httpx.post(f"{server.url}/generate", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert "Paris" in response.json()["generated_text"]
    finally:
        server.stop()


@pytest.mark.slow
# fp4 shares nf4's code path (another quant_type); tests/quantization covers its fidelity.
@pytest.mark.parametrize("method", ["bitsandbytes", "bitsandbytes-nf4"])
def test_bitsandbytes_methods_answer_on_the_default_model(
    method: str, default_model_dir: Path, chat_prompt: str
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = load_model(default_model_dir, torch.bfloat16, "cpu", quantize=method)
    # Unquantized bf16: linears 212 MB, embedding 57 MB and the head's packed copy 57 MB;
    # bitsandbytes keeps the head in bf16 and shrinks the linears to 8 or 4 bits.
    assert resident_bytes(model) < 0.75 * 326e6
    # One prefill over the question and the start of the answer: the next token is Paris.
    tokens = tokenizer(chat_prompt + "The capital of France is")["input_ids"]
    metadata = AttentionMetadata.build(
        query_lens=[len(tokens)], context_lens=[0], block_tables=[[0, 1]], block_size=64
    )
    cache = model.allocate_kv_cache(num_blocks=2, block_size=64)
    rows = torch.tensor([len(tokens) - 1])
    with torch.inference_mode():
        logits = model(torch.tensor(tokens), metadata.positions(), cache, metadata, rows)
    assert tokenizer.decode([int(logits[0].argmax())]).strip() == "Paris"
