"""TGI's `parameters.grammar` to a `GrammarSpec`, checked as far as the router can tell.

TGI's shapes: `{"type": "json", "value": <JSON schema>}` (the schema as an object, or
as a string holding one; `json_object` is an alias), `{"type": "regex", "value":
"<regular expression>"}`, and `{"type": "json_schema", "value": {"name": ..., "schema":
<JSON schema>}}`. A schema that is not valid JSON Schema (checked against its
metaschema) or a pattern Python cannot parse is a `GrammarSpecError` here (422); what
only the shard's grammar engine can refuse (a feature it does not support) fails the
request with the engine's message.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jsonschema import SchemaError
from jsonschema.validators import validator_for

from textgate.router.engine.request import GrammarSpec

GRAMMAR_SHAPE = (
    '`grammar` must be {"type": "json", "value": <JSON schema>} or '
    '{"type": "regex", "value": "<regular expression>"}'
)


class GrammarSpecError(ValueError):
    """A grammar the router refuses; the message says why."""


def parse_grammar(grammar: Any) -> GrammarSpec:
    """The grammar of a TGI request; GrammarSpecError for anything malformed."""
    if not isinstance(grammar, dict) or set(grammar) - {"type", "value"}:
        raise GrammarSpecError(GRAMMAR_SHAPE)
    kind, value = grammar.get("type"), grammar.get("value")
    if kind in ("json", "json_object"):
        return json_schema_grammar(_schema_value(value))
    if kind == "json_schema":
        if not isinstance(value, dict) or "schema" not in value:
            raise GrammarSpecError(
                '`grammar` of type "json_schema" needs `value` {"name": ..., "schema": {...}}'
            )
        return json_schema_grammar(_schema_value(value["schema"]))
    if kind == "regex":
        return regex_grammar(value)
    raise GrammarSpecError(f"{GRAMMAR_SHAPE}; unknown type {kind!r}")


def json_schema_grammar(schema: Any) -> GrammarSpec:
    """A grammar for JSON values matching `schema` (an object, or true for any JSON)."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarSpecError("a JSON schema must be an object")
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "the top level"
        raise GrammarSpecError(f"not a valid JSON schema at {where}: {exc.message}") from None
    return GrammarSpec("json", json.dumps(schema))


def regex_grammar(pattern: Any) -> GrammarSpec:
    """A grammar for text that matches `pattern` as a whole."""
    if not isinstance(pattern, str) or not pattern:
        raise GrammarSpecError('`grammar` of type "regex" needs a non-empty string `value`')
    try:
        re.compile(pattern)
    except re.error as exc:
        raise GrammarSpecError(f"not a valid regular expression: {exc}") from None
    return GrammarSpec("regex", pattern)


def _schema_value(value: Any) -> Any:
    """TGI accepts the schema as an object or as a string of JSON."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise GrammarSpecError(f"the JSON schema string is not JSON: {exc}") from None
    if isinstance(value, dict) or value is True:
        return value
    raise GrammarSpecError("a JSON grammar's `value` must be a schema object or a JSON string")
