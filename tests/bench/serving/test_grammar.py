"""textgate-bench's structured-output option: the schema in each backend's body, and its checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from textgate.bench.serving.backends import GenerationSettings, get_backend
from textgate.bench.serving.cli import build_parser, config_from_args
from textgate.bench.serving.workload import BenchRequest

REQUEST = BenchRequest(prompt="Hello there", prompt_len=2)
SCHEMA = {"type": "object", "properties": {"body": {"type": "string"}}}
SHIPPED = Path(__file__).parents[3] / "bench" / "data" / "grammar_schema.json"


def test_the_schema_goes_where_each_api_reads_it() -> None:
    settings = GenerationSettings(output_len=8, json_schema=SCHEMA)
    tgi = get_backend("tgi").payload(REQUEST, settings)
    assert tgi["parameters"]["grammar"] == {"type": "json", "value": SCHEMA}
    chat = get_backend("openai-chat").payload(REQUEST, settings)
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "bench", "schema": SCHEMA},
    }
    with pytest.raises(ValueError, match="no JSON schema field"):
        get_backend("openai-completions").payload(REQUEST, settings)
    plain = GenerationSettings(output_len=8)
    assert "grammar" not in get_backend("tgi").payload(REQUEST, plain)["parameters"]
    assert "response_format" not in get_backend("openai-chat").payload(REQUEST, plain)


def test_grammar_on_one_target_of_a_comparison() -> None:
    args = build_parser().parse_args(
        ["--compare", "http://x", "--grammar-json-schema", str(SHIPPED), "--grammar-on", "B"]
    )
    config = config_from_args(args)
    assert config.json_schema == json.loads(SHIPPED.read_text())
    assert config.grammar_on == ("B",)
    assert config_from_args(build_parser().parse_args([])).json_schema is None


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("[1, 2]", [], "must hold a JSON schema object"),
        ("{oops", [], "--grammar-json-schema"),
        ("{}", ["--backend", "openai-completions"], "tgi or openai-chat"),
    ],
)
def test_unusable_schema_files_are_errors(
    tmp_path: Path, content: str, extra: list[str], message: str
) -> None:
    path = tmp_path / "schema.json"
    path.write_text(content)
    args = build_parser().parse_args(["--grammar-json-schema", str(path), *extra])
    with pytest.raises(ValueError, match=message):
        config_from_args(args)
