"""TGI's own client, `text-generation==0.7.0` (in its own venv), against a live textgate."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

# The keys of CHECKS in tgi_client_check.py (which only imports under the compat venv).
CHECK_NAMES = [
    "generate",
    "generate_details",
    "generate_stream",
    "generate_stream_top_n",
    "validation_errors",
    "chat",
]


def _load_tgi_venv() -> ModuleType:
    # Test folders are not packages (--import-mode=importlib), so load the helper by path.
    path = Path(__file__).with_name("tgi_venv.py")
    spec = importlib.util.spec_from_file_location("textgate_tests_tgi_venv", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


tgi_venv = _load_tgi_venv()


@pytest.fixture(scope="module")
def tgi_report(live_server: str) -> dict[str, Any]:
    """The JSON report of tgi_client_check.py run against the live server."""
    try:
        tgi_venv.ensure_venv()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
        pytest.fail(f"cannot build the text-generation==0.7.0 venv (it needs PyPI): {err}")
    return tgi_venv.run_check(live_server)


def test_every_check_ran(tgi_report: dict[str, Any]) -> None:
    assert sorted(tgi_report["checks"]) == sorted(CHECK_NAMES)


# The client posts every unset chat field as an explicit null; /v1/chat/completions still
# refuses `"n": null` and `"logprobs": null` (router/openai_schemas.py). Not strict: the
# mark only has to go once the OpenAI schema accepts those nulls.


@pytest.mark.parametrize("check", CHECK_NAMES)
def test_tgi_client_check(tgi_report: dict[str, Any], check: str) -> None:
    result = tgi_report["checks"][check]
    assert result["ok"], json.dumps(result, indent=2)
