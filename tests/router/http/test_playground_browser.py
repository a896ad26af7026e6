"""The chat playground in a real headless Chromium, against the real router and a fake shard.

The fake shard's model is scripted here: a prompt that mentions "Python" is answered with
a markdown code block, one that mentions "script tag" with HTML meant to run, anything
else with the toy model's " t10 t11 …". Streaming, cancellation and errors go through
the real router and engine (paged) over HTTP, as a user's browser would see them.

Without Chromium these tests fail (CI installs it with `make test`);
TEXTGATE_SKIP_BROWSER_TESTS=1 skips them instead. TEXTGATE_SCREENSHOT_DIR=docs/images
writes the screenshots there (the docs' images) instead of a temp folder.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from textgate.proto import generate_pb2 as pb
from textgate.tests.router import fake_shard as fake_shard_module
from textgate.tests.router.fake_model import FakeSequence
from textgate.tests.router.fake_shard import FakeShard, fake_shards
from textgate.tests.router.http.chromium import NOT_INSTALLED, Chromium, Page, chromium_executable
from textgate.tests.router.openai.routes_helpers import ChatFakeTokenizer

StartRouter = Callable[..., Awaitable[str]]
LIMITS = {"max_input_tokens": 1024, "max_total_tokens": 4096, "max_batch_prefill_tokens": 4096}
CODE_ANSWER = (
    "## Streaming\n\nCall the **OpenAI** route with `stream=True`:\n\n"
    "```python\nfor chunk in client.chat.completions.create(stream=True):\n"
    "    print(chunk.choices[0].delta.content, end='')\n```\n"
    "- tokens arrive as they are made\n- *Stop* cancels on the server\n\n"
    "> see [the docs](https://example.com/docs)\n\n1. first\n2. second"
)
INJECTION_ANSWER = (
    'Here: <script>window.__pwned = "script"</script> and '
    "<img src=x onerror=\"window.__pwned = 'img'\"> and [a link](javascript:window.__pwned=1) "
    "**done**"
)
SCRIPTS = {"Python": CODE_ANSWER, "script tag": INJECTION_ANSWER}
# The assistant message being written, and its text.
LAST_BODY = "[...document.querySelectorAll('.message.assistant .body')].at(-1)"


def pieces(text: str) -> list[str]:
    """A scripted answer's tokens: each word with the whitespace before it."""
    return re.findall(r"\s*\S+", text)


@pytest.fixture
def scripted_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake shard answers the prompts named in SCRIPTS with their text, token by token
    (the token ids stay the toy model's, so the router's bookkeeping is unchanged)."""
    toy_generation = fake_shard_module.next_generation

    def generate(seq: FakeSequence, eos_after: int | None) -> pb.Generation:
        generation = toy_generation(seq, eos_after)
        prompt = seq.request.inputs
        # The latest message decides: earlier turns stay in the prompt.
        found = [(prompt.rfind(key), text) for key, text in SCRIPTS.items() if key in prompt]
        if not found:
            return generation
        parts = pieces(max(found)[1])
        num_generated = len(seq.ids)
        generation.tokens.texts[0] = parts[num_generated - 1]
        seq.text = "".join(parts[:num_generated])
        if num_generated == len(parts) and not generation.HasField("generated_text"):
            done = pb.GeneratedText(
                generated_tokens=num_generated, finish_reason=pb.FINISH_REASON_EOS_TOKEN
            )
            generation.generated_text.CopyFrom(done)
        if generation.HasField("generated_text"):
            generation.generated_text.text = seq.text
        return generation

    monkeypatch.setattr(fake_shard_module, "next_generation", generate)


@pytest.fixture
async def fake(uds_path: str, scripted_model: None) -> AsyncIterator[FakeShard]:
    """One paged fake shard (the engine real models use); overrides the both-engines one."""
    async with fake_shards(uds_path) as shards:
        shards[0].step_delay_s = 0.02
        yield shards[0]


@pytest.fixture
def browser_profile(tmp_path: Path) -> Path:
    if chromium_executable() is None:
        if os.environ.get("TEXTGATE_SKIP_BROWSER_TESTS") == "1":
            pytest.skip("TEXTGATE_SKIP_BROWSER_TESTS=1")
        pytest.fail(NOT_INSTALLED)
    return tmp_path / "chromium-profile"


@pytest.fixture
async def browser(browser_profile: Path) -> AsyncIterator[Chromium]:
    async with Chromium.launch(browser_profile) as chromium:
        yield chromium


@pytest.fixture
def start_playground(start_router: StartRouter) -> StartRouter:
    async def start(**overrides: Any) -> str:
        return await start_router(ChatFakeTokenizer(), **{**LIMITS, **overrides})

    return start


async def open_playground(
    browser: Chromium, url: str, width: int = 1280, height: int = 900
) -> Page:
    """`url` in a new tab, loaded, with a recorder of the answers' DOM updates."""
    page = await browser.new_page(width, height)
    await page.goto(url)
    await page.wait_until("document.querySelector('#model').textContent.includes('textgate')")
    # Every change to the conversation: (time, the answer's text length, still streaming?).
    await page.evaluate(
        """window.__updates = [];
        new MutationObserver(() => {
          const answers = document.querySelectorAll('.message.assistant');
          const last = answers[answers.length - 1];
          if (last) window.__updates.push([performance.now(),
            last.querySelector('.body').textContent.length, last.classList.contains('streaming')]);
        }).observe(document.querySelector('#log'), {subtree: true, childList: true, characterData: true});
        true"""
    )
    return page


async def set_field(page: Page, selector: str, value: str) -> None:
    """Type `value` into a settings field as a user would (the change event saves it)."""
    await page.evaluate(
        f"""(() => {{ const input = document.querySelector({selector!r});
        input.value = {value!r}; input.dispatchEvent(new Event('change', {{bubbles: true}}));
        return true; }})()"""
    )


async def ask(page: Page, text: str) -> None:
    """Focus the message box, type `text` and press Enter (the keyboard's send)."""
    await page.evaluate("document.querySelector('#prompt').focus(), true")
    await page.type_text(text)
    await page.press_enter()


async def wait_answered(page: Page, num_answers: int, timeout_s: float = 15.0) -> str:
    """Wait until answer `num_answers` has ended; its rendered text."""
    await page.wait_until(
        f"document.querySelectorAll('.message.assistant').length >= {num_answers} && "
        "!document.querySelector('.streaming') && document.querySelector('#send').disabled === false",
        timeout_s,
    )
    return str(await page.evaluate(f"{LAST_BODY}.textContent"))


async def cancelled_count(client: httpx.AsyncClient) -> float:
    metrics = (await client.get("/metrics")).text
    series = 'textgate_request_cancelled{reason="client_disconnected"} '
    found = re.search(rf"^{re.escape(series)}(\S+)$", metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def screenshot_dir(tmp_path: Path) -> Path:
    chosen = os.environ.get("TEXTGATE_SCREENSHOT_DIR")
    return Path(chosen) if chosen else tmp_path


async def test_answers_stream_in_with_stats_history_and_settings(
    browser: Chromium, start_playground: StartRouter, fake: FakeShard
) -> None:
    url = await start_playground()
    page = await open_playground(browser, url)  # GET / with a browser's Accept header
    await set_field(page, "#system", "Answer in w7 words.")
    await set_field(page, "#temperature", "0.5")
    await set_field(page, "#top-p", "0.9")
    await set_field(page, "#max-tokens", "40")

    # Shift+Enter is a new line, not a send.
    await page.evaluate("document.querySelector('#prompt').focus(), true")
    await page.type_text("w5")
    await page.press_enter(shift=True)
    assert await page.evaluate("document.querySelector('#prompt').value") == "w5\n"
    assert not fake.received_requests()
    await page.press_enter()

    text = await wait_answered(page, 1)
    assert text.split() == [f"t{i}" for i in range(10, 50)]
    updates = await page.evaluate("window.__updates")
    lengths_while_streaming = sorted({length for _, length, streaming in updates if streaming})
    assert len([n for n in lengths_while_streaming if 0 < n < len(text)]) >= 5, updates
    stats = await page.evaluate("document.querySelector('.message.assistant .stats').textContent")
    assert re.fullmatch(r"TTFT \d+ ms · 40 tokens · \d+\.\d tokens/s", stats), stats

    (first,) = fake.received_requests()
    assert first.inputs == "Answer in w7 words. w5\n w9"  # the system prompt, then the message
    assert first.parameters.temperature == pytest.approx(0.5)
    assert first.parameters.top_p == pytest.approx(0.9)
    assert first.stopping_parameters.max_new_tokens == 40

    # The next message carries the conversation so far.
    await ask(page, "w6")
    await wait_answered(page, 2)
    second = fake.received_requests()[1]
    assert second.inputs.startswith(f"Answer in w7 words. w5\n {text} w6")

    # New chat forgets it.
    await page.evaluate("document.querySelector('#new-chat').click(), true")
    assert await page.evaluate("document.querySelectorAll('.message').length") == 0
    await ask(page, "w6")
    await wait_answered(page, 1)
    assert fake.received_requests()[2].inputs == "Answer in w7 words. w6 w9"

    # Settings survive a reload (localStorage).
    await page.goto(f"{url}/chat")
    assert await page.evaluate("document.querySelector('#max-tokens').value") == "40"
    assert await page.evaluate("document.querySelector('#system').value") == "Answer in w7 words."
    assert page.problems() == []


async def test_markdown_renders_as_nodes_and_model_html_never_runs(
    browser: Chromium, start_playground: StartRouter, fake: FakeShard, tmp_path: Path
) -> None:
    url = await start_playground()
    page = await open_playground(browser, f"{url}/chat")
    await ask(page, "How do I stream an answer in Python?")
    await wait_answered(page, 1)
    code = await page.evaluate(
        f"(() => {{ const c = {LAST_BODY}.querySelector('pre > code');"
        " return c && [c.className, c.textContent]; })()"
    )
    assert code == [
        "language-python",
        "for chunk in client.chat.completions.create(stream=True):\n"
        "    print(chunk.choices[0].delta.content, end='')",
    ]
    tags = await page.evaluate(
        f"[...{LAST_BODY}.querySelectorAll('*')].map(e => e.tagName.toLowerCase())"
    )
    assert {"h3", "strong", "code", "pre", "ul", "li", "em", "blockquote", "ol"} <= set(tags)
    link = await page.evaluate(
        f"(a => [a.href, a.rel, a.textContent])({LAST_BODY}.querySelector('blockquote a'))"
    )
    assert link == ["https://example.com/docs", "noopener noreferrer", "the docs"]
    stats = await page.evaluate("[...document.querySelectorAll('.stats')].at(-1).textContent")
    assert f" · {len(pieces(CODE_ANSWER))} tokens" in stats

    shots = screenshot_dir(tmp_path)
    desktop = await page.screenshot(shots / "playground-desktop.png")
    # A phone: settings start folded (as the page opens them only on wide screens).
    await page.resize(360, 740)
    await page.evaluate(
        "document.querySelector('#settings').open = false,"
        " window.scrollTo(0, document.body.scrollHeight), true"
    )
    fits = await page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    assert fits, "the page scrolls sideways at 360 px"
    phone = await page.screenshot(shots / "playground-phone.png")
    assert desktop.startswith(b"\x89PNG") and phone.startswith(b"\x89PNG")
    assert int.from_bytes(phone[16:20], "big") == 360  # the PNG's width

    await ask(page, "Answer with a script tag")
    text = await wait_answered(page, 2)
    assert '<script>window.__pwned = "script"</script>' in text
    assert "<img src=x onerror=" in text
    assert await page.evaluate("window.__pwned === undefined")
    dangerous = f"{LAST_BODY}.querySelectorAll('script, img, [onerror], a[href^=javascript]')"
    assert await page.evaluate(f"{dangerous}.length") == 0
    assert await page.evaluate(f"{LAST_BODY}.querySelector('strong').textContent") == "done"
    assert page.problems() == []


async def test_stop_aborts_the_stream_and_the_server_cancels(
    browser: Chromium, start_playground: StartRouter, fake: FakeShard
) -> None:
    url = await start_playground()
    page = await open_playground(browser, url)
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        before = await cancelled_count(client)
        await set_field(page, "#max-tokens", "3000")
        await ask(page, "w5")
        await page.wait_until(f"{LAST_BODY}.textContent.split(' ').length > 5")
        assert fake.held_request_ids()
        await page.evaluate("document.querySelector('#stop').click(), true")
        await wait_answered(page, 1, timeout_s=5)
        note = await page.evaluate("document.querySelector('.message.assistant .note').textContent")
        assert note == "Stopped."
        for _ in range(250):
            if await cancelled_count(client) > before and not fake.held_request_ids():
                break
            await asyncio.sleep(0.02)
        assert await cancelled_count(client) == before + 1
        assert not fake.held_request_ids(), "the shard still generates the stopped answer"
    assert page.problems() == []


async def test_errors_are_shown_and_the_api_key_is_sent_and_remembered(
    browser: Chromium, start_playground: StartRouter, fake: FakeShard
) -> None:
    url = await start_playground(api_key="sesame")
    page = await open_playground(browser, url)
    await ask(page, "w5")
    await wait_answered(page, 1)
    shown = await page.evaluate("document.querySelector('#error').textContent")
    assert shown.startswith("HTTP 401") and "Unauthorized" in shown and "API key" in shown
    assert not await page.evaluate("document.querySelector('#error').hidden")

    await page.evaluate(
        """(() => { const key = document.querySelector('#api-key');
        key.value = 'sesame'; key.dispatchEvent(new Event('input')); return true; })()"""
    )
    await set_field(page, "#max-tokens", "6")
    await ask(page, "w5")
    text = await wait_answered(page, 2)
    assert text.split() == ["t10", "t11", "t12", "t13", "t14", "t15"]
    assert await page.evaluate("document.querySelector('#error').hidden")
    notes = await page.evaluate("[...document.querySelectorAll('.note')].map(n => n.textContent)")
    assert notes[-1] == "Reached the max tokens."

    # A failure mid-stream arrives as an SSE error event: shown, not swallowed.
    await page.goto(url)  # the key is remembered
    assert await page.evaluate("document.querySelector('#api-key').value") == "sesame"
    await set_field(page, "#max-tokens", "200")
    await ask(page, "w5")
    await page.wait_until(f"{LAST_BODY}.textContent.length > 0")
    fake.fail["Step"] = 1
    await wait_answered(page, 1)
    shown = await page.evaluate("document.querySelector('#error').textContent")
    assert shown.startswith("The server ended the answer with an error (generation"), shown
    failed = await page.evaluate("document.querySelector('.note.failed').textContent")
    assert failed == shown
    network = [p for p in page.problems() if "401" not in p]
    assert network == []


@pytest.mark.e2e
async def test_the_default_model_streams_into_the_page_and_stops(
    browser: Chromium, live_server: str, tmp_path: Path
) -> None:
    """The launcher serving the embedded default model: the same page, real tokens, a real
    stop. Its screenshots are the docs' (TEXTGATE_SCREENSHOT_DIR=docs/images)."""
    page = await open_playground(browser, live_server)
    await set_field(page, "#temperature", "0")
    await set_field(page, "#max-tokens", "40")
    await ask(page, "Write a Python function that adds two numbers.")
    text = await wait_answered(page, 1, timeout_s=120)
    assert text.strip()
    updates = await page.evaluate("window.__updates")
    assert len({length for _, length, streaming in updates if streaming and length}) >= 5
    stats = await page.evaluate("document.querySelector('.message.assistant .stats').textContent")
    assert re.fullmatch(r"TTFT \d+ ms · \d+ tokens · \d+\.\d tokens/s", stats), stats
    shots = screenshot_dir(tmp_path)
    await page.screenshot(shots / "playground-desktop.png")
    await page.resize(360, 740)
    await page.evaluate(
        "document.querySelector('#settings').open = false,"
        " window.scrollTo(0, document.body.scrollHeight), true"
    )
    assert await page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    await page.screenshot(shots / "playground-phone.png")

    async with httpx.AsyncClient(base_url=live_server, timeout=30) as client:
        before = await cancelled_count(client)
        await set_field(page, "#max-tokens", "1000")
        await ask(page, "Tell me a very long story about a lighthouse keeper.")
        await page.wait_until(f"{LAST_BODY}.textContent.trim().length > 0", 120)
        await page.evaluate("document.querySelector('#stop').click(), true")
        await wait_answered(page, 2, timeout_s=10)
        idle = re.compile(r"^tgi_batch_current_size 0(\.0)?$", re.MULTILINE)
        for _ in range(100):
            metrics = (await client.get("/metrics")).text
            if await cancelled_count(client) > before and idle.search(metrics):
                break
            await asyncio.sleep(0.05)
        assert await cancelled_count(client) == before + 1
        assert idle.search(metrics), "the engine still runs the stopped answer"
    assert page.problems() == []
