from __future__ import annotations

import httpx

from textgate.bench.serving.load import LoadLevel
from textgate.bench.serving.runner import BenchConfig, Target, resolve_model_name, run_benchmark
from textgate.bench.serving.tokenizer import load_tokenizer
from textgate.bench.serving.workload import WorkloadSpec


async def test_model_name_comes_from_the_target_then_the_server_then_tgi(fake_server) -> None:
    url, _ = fake_server
    async with httpx.AsyncClient() as client:
        assert await resolve_model_name(client, Target(url, model="mine")) == "mine"
        assert await resolve_model_name(client, Target(url)) == "fake-model"
        assert await resolve_model_name(client, Target(url + "/nowhere")) == "tgi"


async def test_results_are_ordered_by_level_then_target(fake_server, tiny_tokenizer_dir) -> None:
    url, fake = fake_server
    config = BenchConfig(
        workload=WorkloadSpec(input_len=6),
        levels=(LoadLevel(concurrency=2), LoadLevel(request_rate=500.0)),
        output_len=3,
        num_requests=2,
        warmup=1,
    )
    targets = [Target(url, "tgi", name="A"), Target(url, "openai-completions", name="B")]
    messages: list[str] = []
    results = await run_benchmark(
        targets, config, load_tokenizer(tiny_tokenizer_dir), messages.append
    )
    assert [(r.target.name, r.level.label) for r in results] == [
        ("A", "c=2"), ("B", "c=2"), ("A", "r=500/s"), ("B", "r=500/s")
    ]  # fmt: skip
    assert all(r.metrics.completed == 2 and r.rounds == 1 for r in results)
    assert messages[0] == "[A c=2 round 1] 2 requests"
    # A and B got the same prompts in each round.
    prompts = [b.get("inputs", b.get("prompt")) for b in fake.bodies]
    assert prompts[:3] == prompts[3:6]


async def test_several_models_are_taken_in_turn(fake_server, tiny_tokenizer_dir) -> None:
    url, fake = fake_server
    config = BenchConfig(
        workload=WorkloadSpec(input_len=6),
        levels=(LoadLevel(concurrency=1),),
        output_len=3,
        num_requests=6,
        warmup=0,
    )
    target = Target(url, "openai-completions", model="base,lora0,lora1")
    (result,) = await run_benchmark([target], config, load_tokenizer(tiny_tokenizer_dir))
    assert result.metrics.completed == 6
    assert [body["model"] for body in fake.bodies] == ["base", "lora0", "lora1"] * 2
