"""Property: a stream says exactly what the non-streamed answer says, field by field.

Texts a model could generate (tool call objects with nested objects, arrays, strings with
escapes and unicode; no_tool answers; plain text with stop sequences), cut short or not,
are tokenized in random ways over the embedded model's real vocabulary (so `{"`, `":`,
` {"`, `"}` and other multi-character tokens fall anywhere), decoded token by token as
the shard does (shard_server/step/detokenizer.py: empty texts while a character is
incomplete), and delivered in events of random sizes (a slow reader's coalesced writes).
The same events then make a stream (OpenAI chunks, TGI frames) and a non-streamed answer;
the joined stream must equal the answer: content, each call's name and arguments, finish
reason, and TGI's tokens against `generated_text`.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from textgate.router.engine.channel import Channel, Finished, StepEvent, TokenInfo
from textgate.router.generation.result import collect
from textgate.router.generation.schemas import GenerateParameters
from textgate.router.generation.stop_text import TextOptions
from textgate.router.generation.tools import NO_TOOL
from textgate.router.openai.output import ResponseMeta, chat_completion
from textgate.router.openai.stream import ChatChunks
from textgate.router.tgi.output import generate_response, stream_frames
from textgate.shard_server.step.detokenizer import IncrementalDetokenizer

CASES_PER_STYLE = 80
META = ResponseMeta(id="chatcmpl-1", created=1, model="m")
PROMPT = "<|im_start|>user\nWeather in Rome?<|im_end|>\n<|im_start|>assistant\n"
WORDS = ["Rome", "東京", "café", "naïve", "🙂", "a\"b", "back\\slash", "new\nline", "tab\t", "{x}", "[1]", ":", ",", " ", "", "ß", "𝄞"]  # fmt: skip


@dataclass
class Vocab:
    """The embedded model's tokenizer, with every ordinary token's bytes."""

    tokenizer: Any
    ids: dict[bytes, int]
    max_len: int

    def tokenize(self, text: str, rng: random.Random) -> list[int]:
        """`text` as some token sequence a model could sample: the tokenizer's own, or at
        each position a random vocabulary token that matches (long ones preferred)."""
        if rng.random() < 0.25:
            ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
            return ids
        data, start, ids = text.encode(), 0, []
        while start < len(data):
            fits = [
                (self.ids[data[start : start + n]], n)
                for n in range(1, min(self.max_len, len(data) - start) + 1)
                if data[start : start + n] in self.ids
            ]
            assert fits, f"no token spells {data[start:]!r}"
            token, length = fits[-1] if rng.random() < 0.5 else rng.choice(fits)
            ids.append(token)
            start += length
        return ids


@pytest.fixture(scope="module")
def vocab(default_model_dir: Path) -> Vocab:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    special = set(tokenizer.all_special_ids)
    ids: dict[bytes, int] = {}
    for token_id, data in enumerate(info.decoded_vocab):
        if data and token_id not in special:
            ids.setdefault(data, token_id)
    return Vocab(tokenizer, ids, max(len(b) for b in ids))


def a_string(rng: random.Random) -> str:
    return "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 6)))


def a_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.choice(["object", "array", "string", "string", "int", "float", "bool", "null"])
    if depth >= 3 and kind in ("object", "array"):
        kind = "string"
    if kind == "object":
        return an_object(rng, depth + 1)
    if kind == "array":
        return [a_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {
        "string": lambda: a_string(rng),
        "int": lambda: rng.randint(-(10**12), 10**12),
        "float": lambda: round(rng.uniform(-1000, 1000), rng.randint(0, 6)),
        "bool": lambda: rng.random() < 0.5,
        "null": lambda: None,
    }[kind]()


def an_object(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    keys = ["city", "unit", "filters", "q", "ünï", "a b", 'x"y', "items"]
    return {rng.choice(keys): a_value(rng, depth) for _ in range(rng.randint(0, 4))}


def call_text(rng: random.Random, auto: bool) -> str:
    """A call object as the tools grammar generates it (compact, the schema's order)."""
    if auto and rng.random() < 0.4:
        call: dict[str, Any] = {"name": NO_TOOL, "arguments": {"content": a_string(rng)}}
    else:
        name = rng.choice(["get_weather", "search-v2", "f_1"])
        call = {"name": name, "arguments": an_object(rng)}
    return json.dumps(call, ensure_ascii=rng.random() < 0.3)


def shard_events(vocab: Vocab, text: str, rng: random.Random, stop: str = "") -> list[StepEvent]:
    """The events a shard sends for `text` sampled as some tokens: cut short (length), ended
    with end-of-sequence, or stopped by `stop`; joined into events of 1-4 tokens."""
    tokenizer = vocab.tokenizer
    ids = vocab.tokenize(text, rng)
    reason = "eos_token"
    if rng.random() < 0.35:
        ids, reason = ids[: rng.randint(1, len(ids))] if ids else ids, "length"
    elif rng.random() < 0.5 or not ids:
        ids = [*ids, tokenizer.eos_token_id]
    else:
        reason = "length"  # the budget ended exactly where the text did
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer.for_prompt(len(prompt))
    all_ids, tokens, seen = list(prompt), [], ""
    special = set(tokenizer.all_special_ids)
    for token_id in ids:
        all_ids.append(token_id)
        piece = detokenizer.step(tokenizer, all_ids)
        tokens.append(TokenInfo(token_id, piece, -0.5, token_id in special))
        seen += "" if token_id in special else piece
        if stop and stop in seen:
            reason = "stop_sequence"
            break
    generated = all_ids[len(prompt) :]
    finished = Finished(
        text=tokenizer.decode(generated, skip_special_tokens=True),
        generated_tokens=len(generated),
        finish_reason=reason,  # type: ignore[arg-type]
        seed=None,
    )
    events, start = [], 0
    while start < len(tokens):
        size = rng.randint(1, 4)
        events.append(StepEvent(tokens[start : start + size]))
        start += size
    events[-1] = StepEvent(events[-1].tokens, finished=finished)
    return events


def channel_of(events: list[StepEvent]) -> Channel:
    channel = Channel(3)
    for event in events:
        channel.push(event)
    return channel


def streamed_chat(events: list[StepEvent], tools: bool, options: TextOptions) -> dict[str, Any]:
    """What a client assembles from the chunks; each chunk has at most one entry per call,
    the first naming it (so a client reading only `tool_calls[0]` loses nothing)."""
    writer = ChatChunks(META, 1, options, logprobs=False, tools=tools)
    content, calls, reason = "", [], None
    for event in events:
        chunk = writer.step(0, event)
        if chunk is None:
            continue
        (choice,) = json.loads(chunk.model_dump_json())["choices"]
        content += choice["delta"].get("content") or ""
        entries = choice["delta"].get("tool_calls") or []
        assert len({e["index"] for e in entries}) == len(entries)
        for entry in entries:
            if entry["index"] == len(calls):
                assert entry["id"].startswith("call_") and entry["type"] == "function"
                calls.append([entry["function"]["name"], ""])
            calls[entry["index"]][1] += entry["function"]["arguments"]
        reason = choice["finish_reason"] or reason
    return {"content": content or None, "calls": calls, "finish_reason": reason}


def answered_chat(events: list[StepEvent], tools: bool, options: TextOptions) -> dict[str, Any]:
    generated = asyncio.run(collect(channel_of(events)))
    body = chat_completion(META, [generated], 3, options, logprobs=False, tools=tools)
    (choice,) = json.loads(body.model_dump_json())["choices"]
    message = choice["message"]
    calls = [
        [c["function"]["name"], c["function"]["arguments"]] for c in message.get("tool_calls") or []
    ]
    return {
        "content": message["content"] or None,
        "calls": calls,
        "finish_reason": choice["finish_reason"],
    }


@pytest.mark.parametrize("style", ["required", "auto"])
def test_streamed_tool_calls_join_to_the_answer(vocab: Vocab, style: str) -> None:
    num_calls = num_complete = 0
    for seed in range(CASES_PER_STYLE):
        rng = random.Random(f"{style}-{seed}")
        text = call_text(rng, auto=style == "auto")
        events = shard_events(vocab, text, rng)
        streamed = streamed_chat(events, True, TextOptions())
        answered = answered_chat(events, True, TextOptions())
        assert streamed == answered, f"seed {seed}: {text!r}"
        num_calls += bool(answered["calls"])
        if answered["calls"] and events[-1].finished and events[-1].finished.text == text:
            # A complete call: its arguments are the generated object's text, exactly.
            name, arguments = answered["calls"][0]
            assert json.loads(text) == {"name": name, "arguments": json.loads(arguments)}
            num_complete += 1
    assert num_calls > CASES_PER_STYLE // 3 and num_complete > 10  # the cases do exercise calls


def test_streamed_text_joins_to_the_answer(vocab: Vocab) -> None:
    for seed in range(CASES_PER_STYLE):
        rng = random.Random(f"plain-{seed}")
        stop = rng.choice(["", "STOP", "\n\n", "}"])
        text = a_string(rng) + (stop if rng.random() < 0.5 else "") + a_string(rng)
        options = TextOptions(stop=(stop,) if stop else (), keep_stop=rng.random() < 0.3)
        events = shard_events(vocab, text, rng, stop)
        assert streamed_chat(events, False, options) == answered_chat(events, False, options), (
            f"seed {seed}: {text!r}"
        )


async def test_tgi_stream_tokens_spell_the_generated_text(vocab: Vocab) -> None:
    params = GenerateParameters(details=True)
    for seed in range(CASES_PER_STYLE):
        rng = random.Random(f"tgi-{seed}")
        events = shard_events(vocab, call_text(rng, auto=True) + a_string(rng), rng)
        frames = [
            f
            async for w in stream_frames(channel_of(events), params, "")
            for f in w.split(b"\n\n")[:-1]
        ]
        payloads = [json.loads(f.removeprefix(b"data: ")) for f in frames]
        spelled = "".join(p["token"]["text"] for p in payloads if not p["token"]["special"])
        assert spelled == payloads[-1]["generated_text"], f"seed {seed}"
        body = generate_response(await collect(channel_of(events)), [], params, "").model_dump(
            mode="json"
        )
        assert body["generated_text"] == spelled
        assert "".join(t["text"] for t in body["details"]["tokens"] if not t["special"]) == spelled
