"""The families with native classes served over HTTP, one launcher each in float32: Phi-3
with LongRoPE, Gemma 2 (soft-caps, a sliding layer then a full one), Gemma 3 text, Mixtral,
and a GPTQ Mixtral from `textgate quantize`. /info names the native class and the
quantization; greedy tokens of concurrent requests equal transformers' `generate` (the
GPTQ one's: over its dequantized twin, the same numbers without textgate's kernels); a
stream gives the same tokens."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from textgate.tests.conftest import build_tiny_model
from textgate.tests.quantization.test_quantize_cli import dequantized_reference
from textgate.tests.quantization.test_quantize_moe import quantize
from textgate.tests.shard_server.models.conftest import build_tiny, longrope

pytestmark = pytest.mark.e2e

# name -> (model type, config overrides on the shard tests' tiny family table).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # Every prompt is past the original context of 8, so the long factors run throughout
    # (transformers' `generate` would re-prefill where a sequence crosses it).
    "phi3-longrope": ("phi3", longrope(8)),
    "gemma2": ("gemma2", {}),
    "gemma3_text": ("gemma3_text", {}),
    "mixtral": ("mixtral", {}),
    "mixtral-gptq": ("mixtral", {}),
}
# Phi-3 and Mixtral are options of the Llama-shaped model; both Gemmas a delta over it.
IMPLEMENTATIONS = {
    "phi3": "native LlamaForCausalLM",
    "gemma2": "native GemmaForCausalLM",
    "gemma3_text": "native GemmaForCausalLM",
    "mixtral": "native LlamaForCausalLM",
}
# 9 to 24 tokens each under the tiny tokenizer.
PROMPTS = [
    "The quick brown fox",
    "A tiny model",
    "Hello world, again and again",
    "Once upon a time there",
]
MAX_NEW_TOKENS = 6


@dataclass
class Served:
    """A launcher serving one family, and what its answers are checked against."""

    url: str
    model_type: str
    quantize: str | None
    tokenizer: PreTrainedTokenizerBase
    reference: PreTrainedModel


def tiny_family(folder: Path, kind: str, **overrides: Any) -> PreTrainedModel:
    """`build_tiny_model`'s tokenizer beside `build_tiny`'s `kind` checkpoint (untied, with
    weights large enough that greedy tokens vary) sized to it; transformers' copy (fp32)."""
    build_tiny_model(folder)  # its Llama weights and config are overwritten next
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    return build_tiny(folder, kind, vocab_size=len(tokenizer), **ids, **overrides)


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, launch_server: Any
) -> Iterator[Served]:
    name = request.param
    kind, overrides = FAMILIES[name]
    root = tmp_path_factory.mktemp(name)
    model = root / "float"
    reference = tiny_family(model, kind, **overrides)
    method = None
    if name.endswith("-gptq"):
        model = quantize(root / "float", root / "gptq", "--method", "gptq")
        reference = dequantized_reference(model, root / "float")
        method = "gptq"
    server = launch_server(root, "--model-id", str(model), "--dtype", "float32")
    try:
        server.wait_ready()
        yield Served(server.url, kind, method, AutoTokenizer.from_pretrained(model), reference)
    finally:
        assert server.stop() == 0


@dataclass
class Greedy:
    """transformers' greedy tokens of one prompt and each one's logprob."""

    tokens: list[int]
    logprobs: list[float]


@pytest.fixture(scope="module")
def expected(served: Served) -> list[Greedy]:
    """transformers' greedy answer to each prompt, in float32."""
    answers = []
    for prompt in PROMPTS:
        ids = torch.tensor([served.tokenizer(prompt)["input_ids"]])
        with torch.inference_mode():
            out = served.reference.generate(
                ids,
                do_sample=False,
                max_new_tokens=MAX_NEW_TOKENS,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[0, ids.shape[1] :].tolist()
        logprobs = [
            float(torch.log_softmax(logits[0], -1)[token])
            for logits, token in zip(out.logits, tokens, strict=True)
        ]
        answers.append(Greedy(tokens, logprobs))
    return answers


def test_info_names_the_native_class_and_the_quantization(served: Served) -> None:
    info = httpx.get(f"{served.url}/info").json()
    assert info["model_implementation"] == IMPLEMENTATIONS[served.model_type]
    assert info["quantize"] == served.quantize
    assert info["model_dtype"] == "float32"


async def _generate(client: httpx.AsyncClient, prompt: str) -> Any:
    parameters = {"max_new_tokens": MAX_NEW_TOKENS, "details": True, "decoder_input_details": True}
    response = await client.post("/generate", json={"inputs": prompt, "parameters": parameters})
    assert response.status_code == 200, response.text
    return response.json()["details"]


async def test_concurrent_greedy_requests_equal_transformers_generate(
    served: Served, expected: list[Greedy]
) -> None:
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
        answers = await asyncio.gather(*(_generate(client, prompt) for prompt in PROMPTS))
    for prompt, details, greedy in zip(PROMPTS, answers, expected, strict=True):
        # The server read the prompt as the reference did.
        assert [t["id"] for t in details["prefill"]] == served.tokenizer(prompt)["input_ids"]
        assert [t["id"] for t in details["tokens"]] == greedy.tokens, prompt
        # Logprobs see what argmax cannot: Gemma 2's final soft-cap, say.
        logprobs = [t["logprob"] for t in details["tokens"]]
        assert logprobs == pytest.approx(greedy.logprobs, abs=1e-4), prompt


async def test_a_stream_gives_the_greedy_tokens(served: Served, expected: list[Greedy]) -> None:
    body = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": MAX_NEW_TOKENS}}
    async with (
        httpx.AsyncClient(base_url=served.url, timeout=60) as client,
        client.stream("POST", "/generate_stream", json=body) as response,
    ):
        assert response.status_code == 200
        events = [
            json.loads(line.removeprefix("data:"))
            async for line in response.aiter_lines()
            if line.startswith("data:")
        ]
    assert [event["token"]["id"] for event in events] == expected[0].tokens
    assert events[-1]["generated_text"] == served.tokenizer.decode(expected[0].tokens)
