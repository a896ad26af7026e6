"""Bad input, fuzzed: every body route answers 4xx with its error body, never a 5xx,
never a hang, and serves a normal request right after.

Two generators over real loopback HTTP to a router on a fake shard:
- schemathesis, from the router's own OpenAPI spec (/api-doc/openapi.json): bodies that
  fit the schema and bodies that break it (wrong types, missing fields, junk nesting);
- hypothesis, by hand, for what a schema cannot express: truncated and non-standard JSON
  (NaN, 1e999, lone surrogates, a key given twice), coercible look-alikes ("5" for an
  int), unicode edge cases, wrong content types, deep nesting and oversized bodies.

Counts are bounded for `make test` (FUZZ_EXAMPLES, default below, per generator);
derandomized so a failure reproduces. `FUZZ_EXAMPLES=5000 pytest tests/router/reliability`
runs a longer search.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from textgate.router.http.request_io import check_standard_json
from textgate.tests.router.reliability.conftest import ThreadedRouter

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "300"))
PAYLOAD_LIMIT = 4096
CALL_TIMEOUT_S = 10
BODY_ROUTES = ("/", "/generate", "/generate_stream", "/tokenize", "/invocations")
OPENAI_ROUTES = ("/v1/chat/completions", "/v1/completions")
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


def assert_error_shape(path: str, status: int, body: Any) -> None:
    """TGI's `{"error", "error_type"}`, or OpenAI's `{"error": {...}, "error_type"}` on /v1."""
    assert isinstance(body, dict), body
    assert isinstance(body.get("error_type"), str), body
    if path.startswith("/v1/"):
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, body
        assert isinstance(error["message"], str) and error["message"], body
    else:
        assert isinstance(body["error"], str) and body["error"], body


def check_answer(path: str, response: httpx.Response | Any) -> None:
    status = response.status_code
    assert status < 500, f"{path}: {status} {response.text[:500]}"
    if status >= 400:
        assert_error_shape(path, status, response.json())


def assert_still_serving(url: str) -> None:
    body = {"inputs": "w5", "parameters": {"max_new_tokens": 3}}
    response = httpx.post(f"{url}/generate", json=body, timeout=CALL_TIMEOUT_S)
    assert response.status_code == 200, response.text
    assert response.json()["generated_text"] == " t6 t7 t8"


@pytest.fixture
def router(serve_in_thread: Callable[..., Any]) -> Any:
    with serve_in_thread(payload_limit=PAYLOAD_LIMIT) as served:
        yield served


def test_schemathesis_cases_from_the_openapi_spec(router: ThreadedRouter) -> None:
    spec = httpx.get(f"{router.url}/api-doc/openapi.json", timeout=CALL_TIMEOUT_S).json()
    schema = schemathesis.openapi.from_dict(spec)
    strategies = [
        schema[path]["POST"].as_strategy(generation_mode=mode)
        for path in (*BODY_ROUTES, *OPENAI_ROUTES)
        for mode in schemathesis.GenerationMode
    ]
    statuses: dict[int, int] = {}

    @FUZZ_SETTINGS
    @given(st.one_of(strategies))
    def call(case: schemathesis.Case) -> None:
        response = case.call(base_url=router.url, timeout=CALL_TIMEOUT_S)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        check_answer(case.path, response)

    call()
    print(f"schemathesis: {sum(statuses.values())} calls, statuses {sorted(statuses.items())}")
    assert sum(statuses.values()) >= EXAMPLES // 2
    assert any(400 <= status < 500 for status in statuses), "no bad input was generated"
    assert_still_serving(router.url)


# ---- by hand: what a schema cannot say ----

UNICODE_EDGES = [
    "e\u0301\u0301\u0301",  # combining marks piled on one letter
    "\u202eabc\u202c \u05e9\u05dc\u05d5\u05dd",  # RTL override, Hebrew
    "\U0001f469\u200d\U0001f469\u200d\U0001f467",  # an emoji ZWJ family (tokens split it)
    "\x00\x01\x7f",  # NUL and control characters
    "\ufeff\ufffe\uffff",  # BOM and noncharacters
    "\U0010ffff",
    "w1 " * 50,
]
RAW_STRINGS = ['"\\ud800"', '"\\udc00x"', '"\\u12"', '"\\x41"', '"tab\there"', '"\\ud83d\\ude00"']
NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e308", "-0", "2e-400"]
NUMBERS += [str(2**64), str(2**1000), "5.0", '"5"', "true", "null", "[]", "{}"]
INT_FIELDS = ("max_new_tokens", "top_k", "seed", "top_n_tokens", "truncate", "best_of")
FLOAT_FIELDS = ("temperature", "top_p", "typical_p", "repetition_penalty", "frequency_penalty")
BOOL_FIELDS = ("do_sample", "details", "decoder_input_details", "return_full_text")


def tgi_body(inputs: str = '"w5"', **parameters: str) -> str:
    """A /generate body with raw JSON text for its values (so non-standard JSON fits in)."""
    fields = {"max_new_tokens": "2", **parameters}
    params = ", ".join(f'"{name}": {value}' for name, value in fields.items())
    return f'{{"inputs": {inputs}, "parameters": {{{params}}}}}'


def raw_bodies() -> st.SearchStrategy[tuple[str, bytes, str]]:
    """(path, body, content type) for the hand-written bad inputs."""
    tgi_paths = st.sampled_from(("/generate", "/generate_stream", "/"))
    valid = json.dumps({"inputs": "w5 w6", "parameters": {"max_new_tokens": 3, "stop": ["w9"]}})
    field_values = st.one_of(
        st.tuples(
            st.sampled_from(INT_FIELDS + FLOAT_FIELDS + BOOL_FIELDS), st.sampled_from(NUMBERS)
        ),
        st.tuples(st.sampled_from(BOOL_FIELDS), st.sampled_from(['"true"', "1", "0", '"yes"'])),
        st.tuples(st.sampled_from(INT_FIELDS), st.sampled_from(['"5"', "5.5", "1e2", "-1"])),
    )
    typed = st.builds(lambda f: tgi_body(**{f[0]: f[1]}), field_values)
    unicode_inputs = st.builds(
        lambda text, extra: json.dumps(
            {"inputs": text + extra, "parameters": {"max_new_tokens": 2}}
        ),
        st.sampled_from(UNICODE_EDGES),
        st.text(max_size=20),
    )
    raw_strings = st.builds(lambda s: tgi_body(inputs=s), st.sampled_from(RAW_STRINGS))
    truncated = st.integers(0, len(valid) - 1).map(lambda n: valid[:n])
    nested = st.integers(1, 5000).map(lambda n: tgi_body(inputs="[" * n + "]" * n))
    junk = st.one_of(
        st.text(max_size=50), st.binary(max_size=50).map(lambda b: b.decode("latin-1"))
    )
    duplicated = st.builds(
        lambda field, value: tgi_body(**{field: f'{value}, "{field}": {value}'}),
        st.sampled_from(INT_FIELDS + FLOAT_FIELDS + BOOL_FIELDS),
        st.sampled_from(["1", "true", '"x"']),
    )
    bodies = st.one_of(typed, unicode_inputs, raw_strings, truncated, nested, junk, duplicated)
    json_type = st.just("application/json")
    content_types = st.one_of(
        json_type, st.sampled_from(["text/plain", "application/x-www-form-urlencoded", ""])
    )
    tgi = st.tuples(
        tgi_paths, bodies.map(lambda s: s.encode("utf-8", "surrogatepass")), content_types
    )
    openai = st.tuples(
        st.sampled_from(OPENAI_ROUTES),
        st.one_of(
            st.builds(
                lambda f: (
                    '{"prompt": "w5", "messages": [{"role": "user", "content": "w5"}], '
                    f'"max_tokens": 2, "{f[0]}": {f[1]}}}'
                ),
                st.tuples(
                    st.sampled_from(["temperature", "top_p", "n", "seed", "stream", "logprobs"]),
                    st.sampled_from(NUMBERS),
                ),
            ),
            truncated,
            unicode_inputs.map(lambda b: b.replace('"inputs"', '"prompt"')),
        ).map(lambda s: s.encode("utf-8", "surrogatepass")),
        json_type,
    )
    invalid_utf8 = st.tuples(tgi_paths, st.just(b'{"inputs": "\xff\xfe"}'), json_type)
    return st.one_of(tgi, openai, invalid_utf8)


def test_hand_written_bad_inputs(router: ThreadedRouter) -> None:
    statuses: dict[int, int] = {}

    @FUZZ_SETTINGS
    @given(raw_bodies())
    def call(case: tuple[str, bytes, str]) -> None:
        path, body, content_type = case
        headers = {"content-type": content_type} if content_type else {}
        response = httpx.post(
            router.url + path, content=body, headers=headers, timeout=CALL_TIMEOUT_S
        )
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        check_answer(path, response)

    call()
    print(f"hand-written: {sum(statuses.values())} calls, statuses {sorted(statuses.items())}")
    assert_still_serving(router.url)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            tgi_body(max_new_tokens='"5"'),
            "parameters.max_new_tokens: Input should be a valid integer",
        ),
        (
            tgi_body(max_new_tokens="5.0"),
            "parameters.max_new_tokens: Input should be a valid integer",
        ),
        (tgi_body(do_sample="1"), "parameters.do_sample: Input should be a valid boolean"),
        (tgi_body(do_sample='"true"'), "parameters.do_sample: Input should be a valid boolean"),
        (tgi_body(temperature='"0.5"'), "parameters.temperature: Input should be a valid number"),
        (tgi_body(temperature="NaN"), "Invalid JSON: expected value, found NaN"),
        (tgi_body(temperature="-Infinity"), "Invalid JSON: expected value, found -Infinity"),
        (tgi_body(temperature="1e999"), "Invalid JSON: number out of range: 1e999"),
        (tgi_body(inputs='"\\udc00x"'), "Invalid JSON: lone leading surrogate"),
        (tgi_body(inputs="5"), "inputs: Input should be a valid string"),
        ('{"inputs": "w5", "inputs": "w6"}', "Invalid JSON: duplicate field `inputs`"),
        (tgi_body(top_k='2, "top_k": 3'), "Invalid JSON: duplicate field `top_k`"),
        ('{"inputs": "w5"} {}', "Invalid JSON: Extra data"),
        ('{"inputs": "w5"},', "Invalid JSON: Extra data"),
        ('\ufeff{"inputs": "w5"}', "Invalid JSON: Expecting value: line 1 column 1"),
    ],
)
def test_nothing_is_coerced_and_only_standard_json_is_read(
    router: ThreadedRouter, body: str, message: str
) -> None:
    response = httpx.post(
        f"{router.url}/generate", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 422, response.text
    assert response.json()["error_type"] == "validation"
    prefix = "Failed to deserialize the JSON body into the target type: "
    assert response.json()["error"].startswith(prefix + message), response.json()


def test_an_integer_is_a_valid_float(router: ThreadedRouter) -> None:
    """JSON has one number type: 1 is a valid temperature (serde reads it as f32 too)."""
    response = httpx.post(
        f"{router.url}/generate", content=tgi_body(temperature="1", do_sample="true")
    )
    assert response.status_code == 200, response.text


def test_oversized_bodies_are_413(router: ThreadedRouter) -> None:
    big = json.dumps({"inputs": "w5 " * PAYLOAD_LIMIT}).encode()
    for path in (*BODY_ROUTES, *OPENAI_ROUTES):
        declared = httpx.post(router.url + path, content=big, timeout=CALL_TIMEOUT_S)
        chunked = httpx.post(router.url + path, content=iter([big]), timeout=CALL_TIMEOUT_S)
        for response in (declared, chunked):
            assert response.status_code == 413, (path, response.text)
            assert_error_shape(path, 413, response.json())
    assert_still_serving(router.url)


# ---- duplicate keys: one reading only ----

DUPLICATED_BODIES = {
    "/generate": '{"inputs": "w5", "parameters": {"max_new_tokens": 2, "max_new_tokens": 900}}',
    "/generate_stream": '{"inputs": "w5", "inputs": "w6"}',
    "/": '{"inputs": "w5", "stream": false, "stream": true}',
    "/tokenize": '{"inputs": "w5", "inputs": "w6"}',
    "/invocations": '{"inputs": "w5", "parameters": {"seed": 1, "seed": 2}}',
    "/v1/chat/completions": (
        '{"messages": [{"role": "user", "content": "w5", "role": "system"}], "max_tokens": 2}'
    ),
    "/v1/completions": '{"prompt": "w5", "max_tokens": 2, "max_tokens": 3}',
}


def test_a_key_given_twice_is_422_on_every_route(router: ThreadedRouter) -> None:
    assert set(DUPLICATED_BODIES) == {*BODY_ROUTES, *OPENAI_ROUTES}
    for path, body in DUPLICATED_BODIES.items():
        response = httpx.post(
            router.url + path, content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == 422, (path, response.text)
        assert_error_shape(path, 422, response.json())
        assert "Invalid JSON: duplicate field `" in response.text, (path, response.text)
    assert_still_serving(router.url)


JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=20,
)


def dumps_with_duplicate(value: Any, duplicate_at: int) -> str:
    """`json.dumps(value)`, except the `duplicate_at`-th non-empty object (in document
    order) repeats its first member at its end."""
    seen = 0

    def dump(item: Any) -> str:
        nonlocal seen
        if isinstance(item, dict):
            index = seen if item else -1
            seen += bool(item)
            members = [f"{json.dumps(k)}: {dump(v)}" for k, v in item.items()]
            if index == duplicate_at:
                members.append(members[0])
            return "{" + ", ".join(members) + "}"
        if isinstance(item, list):
            return "[" + ", ".join(dump(v) for v in item) + "]"
        return json.dumps(item)

    return dump(value)


def count_objects(value: Any) -> int:
    """Non-empty objects in `value`."""
    if isinstance(value, dict):
        return bool(value) + sum(count_objects(v) for v in value.values())
    if isinstance(value, list):
        return sum(count_objects(v) for v in value)
    return 0


@settings(max_examples=min(EXAMPLES, 200), deadline=None, database=None, derandomize=True)
@given(JSON_VALUES, st.data())
def test_standard_json_is_read_and_a_duplicate_key_anywhere_is_refused(
    value: Any, data: st.DataObject
) -> None:
    check_standard_json(json.dumps(value).encode())
    objects = count_objects(value)
    if objects:
        duplicate_at = data.draw(st.integers(0, objects - 1))
        text = dumps_with_duplicate(value, duplicate_at)
        assert json.loads(text) == value  # Python's json: the last one wins, silently
        with pytest.raises(ValueError, match="duplicate field `"):
            check_standard_json(text.encode())


@pytest.mark.parametrize(
    "text",
    [
        "NaN",
        "[Infinity]",
        '{"a": -Infinity}',
        "1e400",
        "[1, 2] 3",
        '{"a": 1}}',
        "",
        "'a'",
        "[1,]",
        '{"a": 1,}',
        "01",
        '"\t"',
        "\ufeff[]",
    ],
)
def test_non_standard_json_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        check_standard_json(text.encode())
    with pytest.raises(ValueError):
        check_standard_json(text.encode("utf-16"))


def test_nesting_too_deep_for_python_is_refused_not_crashed() -> None:
    with pytest.raises(ValueError, match="recursion limit exceeded"):
        check_standard_json(b"[" * 100_000 + b"]" * 100_000)
