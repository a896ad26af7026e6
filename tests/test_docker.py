"""The images, without a Docker engine: what each Dockerfile sets up, read from its text.

The entrypoint's arguments and the image's env go through the launcher's own parser;
the files the image copies cover every package pyproject.toml installs; torch is pinned
from PyTorch's index for the right device.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomllib

from textgate import launcher
from textgate.router.app import OPEN_PATHS

ROOT = Path(launcher.__file__).parent
DOCKERFILES = {"gpu": ROOT / "docker" / "Dockerfile", "cpu": ROOT / "docker" / "Dockerfile.cpu"}


@dataclass
class Image:
    """What a Dockerfile declares (single stage): ENV, ARG defaults, COPY sources, RUNs."""

    env: dict[str, str] = field(default_factory=dict)
    args: dict[str, str] = field(default_factory=dict)
    copied: list[str] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    expose: list[str] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)
    healthcheck: str = ""


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    assert not pending, "a continuation runs off the end"
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def parse(path: Path) -> Image:
    image = Image()
    for name, rest in instructions(path.read_text()):
        if name == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                image.env[key] = value
        elif name == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            image.args[key] = value
        elif name == "COPY":
            *sources, _ = rest.split()
            image.copied += sources
        elif name == "RUN":
            image.runs.append(rest)
        elif name == "ENTRYPOINT":
            image.entrypoint = json.loads(rest)
        elif name == "CMD":
            image.cmd = json.loads(rest)
        elif name == "EXPOSE":
            image.expose += rest.split()
        elif name == "VOLUME":
            image.volumes += rest.split()
        elif name == "HEALTHCHECK":
            image.healthcheck = rest
    return image


def launcher_argv(image: Image) -> list[str]:
    """The launcher's arguments when the container runs with no arguments of its own."""
    (index,) = [i for i, part in enumerate(image.entrypoint) if part == "textgate-launcher"]
    return image.entrypoint[index + 1 :] + image.cmd


@pytest.fixture(params=sorted(DOCKERFILES))
def image(request: pytest.FixtureRequest) -> Image:
    return parse(DOCKERFILES[request.param])


def test_the_entrypoint_serves_tgis_port_with_the_launchers_own_parser(image: Image) -> None:
    assert image.entrypoint[:2] == ["tini", "--"], "PID 1 forwards SIGTERM to the launcher"
    config = launcher.parse_args(launcher_argv(image), env=image.env)
    assert config.port == 80 and config.hostname == "0.0.0.0"
    assert image.expose == ["80"]
    # A user's `docker run IMAGE --model-id ... --num-shard 2` parses on top of the image.
    extra = ["--model-id", "org/model", "--num-shard", "2", "--quantize", "awq"]
    config = launcher.parse_args([*launcher_argv(image), *extra], env=image.env)
    assert (config.model_id, config.num_shard, config.port) == ("org/model", 2, 80)


def test_models_and_caches_live_under_data(image: Image) -> None:
    assert image.volumes == ["/data"]
    # Converted models and compiled kernels (paths.cache_dir), hub downloads (HF_TOKEN is
    # read by huggingface_hub itself from the container's env).
    assert image.env["TEXTGATE_CACHE"].startswith("/data/")
    assert image.env["HF_HOME"].startswith("/data/")
    assert any("useradd --uid 1000" in run for run in image.runs)


def test_the_healthcheck_asks_the_routers_health_route(image: Image) -> None:
    assert f"/health' % os.environ.get('PORT', '{image.env['PORT']}')" in image.healthcheck
    # An open route: the probe works with --api-key too.
    assert "/health" in OPEN_PATHS


def test_the_image_copies_every_installed_package() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = pyproject["tool"]["setuptools"]["packages"]
    folders = {p.split(".")[1] for p in packages if p != "textgate"}
    root_modules = {p.name for p in ROOT.glob("*.py")}
    assert {"launcher.py", "logs.py", "telemetry.py"} <= root_modules
    for name, path in DOCKERFILES.items():
        copied = set(parse(path).copied)
        missing = {f for f in folders if f not in copied}
        assert not missing, f"{name} image lacks {missing}"
        assert "*.py" in copied, f"{name} image lacks the root modules ({sorted(root_modules)})"
        assert {"pyproject.toml", "README.md"} <= copied


@pytest.mark.parametrize(("name", "index"), [("cpu", "/whl/cpu"), ("gpu", "/whl/cu")])
def test_torch_is_pinned_from_pytorchs_index(name: str, index: str) -> None:
    image = parse(DOCKERFILES[name])
    (install,) = [run for run in image.runs if "torch==" in run]
    assert "--index-url" in install
    indexes = [image.args.get("TORCH_INDEX", ""), install]
    assert any(f"https://download.pytorch.org{index}" in text for text in indexes)
    # The version `make test` runs (Makefile's TORCH_SPEC).
    makefile = (ROOT / "Makefile").read_text()
    (pinned,) = re.findall(r"TORCH_SPEC \?= torch==(\S+)", makefile)
    assert image.args["TORCH_VERSION"] == pinned
    if name == "cpu":
        assert '"torch==${TORCH_VERSION}+cpu"' in install
