"""Chat templating with a real transformers tokenizer and a ChatML-style template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from textgate.router.generation.chat_template import has_chat_template, render_chat
from textgate.router.generation.validation import ValidationError
from textgate.tests.router.fake_shard import FakeTokenizer

CHATML = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
    "{% if not (loop.last and continue_final_message) %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
USER = {"role": "user", "content": "Hi"}


@pytest.fixture
def tokenizer(tokenizer_dir: Path) -> Any:
    loaded = AutoTokenizer.from_pretrained(tokenizer_dir)
    loaded.chat_template = CHATML
    return loaded


def test_generation_prompt_ends_with_the_assistant_header(tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, USER]
    assert render_chat(tokenizer, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_without_generation_prompt(tokenizer: Any) -> None:
    prompt = render_chat(tokenizer, [USER], add_generation_prompt=False)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n"


def test_continue_final_message_leaves_the_assistant_prefix_open(tokenizer: Any) -> None:
    messages = [USER, {"role": "assistant", "content": "The answer is"}]
    prompt = render_chat(
        tokenizer, messages, add_generation_prompt=False, continue_final_message=True
    )
    assert prompt.endswith("<|im_start|>assistant\nThe answer is")


def test_continue_final_message_needs_an_assistant_message_last(tokenizer: Any) -> None:
    with pytest.raises(ValidationError, match="assistant"):
        render_chat(tokenizer, [USER], add_generation_prompt=False, continue_final_message=True)


def test_continue_and_generation_prompt_exclude_each_other(tokenizer: Any) -> None:
    messages = [USER, {"role": "assistant", "content": "x"}]
    with pytest.raises(ValidationError, match="cannot both be true"):
        render_chat(tokenizer, messages, add_generation_prompt=True, continue_final_message=True)


def test_template_errors_are_validation_errors(tokenizer: Any) -> None:
    with pytest.raises(ValidationError, match="tool messages are not supported"):
        render_chat(tokenizer, [USER, {"role": "tool", "content": "42"}])


def test_empty_messages_are_rejected(tokenizer: Any) -> None:
    with pytest.raises(ValidationError, match="`messages` cannot be empty"):
        render_chat(tokenizer, [])


def test_a_tokenizer_without_template_is_rejected(tokenizer_dir: Path) -> None:
    plain = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert not has_chat_template(plain)
    assert not has_chat_template(FakeTokenizer())
    for no_template in (plain, FakeTokenizer()):
        with pytest.raises(ValidationError, match="no chat template"):
            render_chat(no_template, [USER])
