"""deploy/: each kustomization rendered here (no kubectl on these machines), checked against
the Kubernetes schemas kubernetes-validate bundles (offline), and against the launcher:
probe paths and ports, GPUs per shard, the drain's grace period, the HPA's metric.

The renderer handles what deploy/ uses of kustomize: `resources` (files and
kustomization folders), `images` (newName / newTag), and `patches` that are
strategic-merge patches by kind and name (maps merge, null deletes a key, lists of named
items merge by name, other lists are replaced). Any other kustomization key fails the test.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from textgate import launcher
from textgate.router.app import OPEN_PATHS
from textgate.router.http.drain import OPEN_WHILE_DRAINING
from textgate.router.metrics import Metrics
from textgate.tests.test_docker import DOCKERFILES, parse

DEPLOY = Path(launcher.__file__).parent / "deploy"
KUSTOMIZATIONS = {"base": DEPLOY / "base", "cpu": DEPLOY / "overlays" / "cpu"}
KUBERNETES_VERSION = "1.33"
KNOWN_KEYS = {"apiVersion", "kind", "resources", "images", "patches"}
Doc = dict[str, Any]


def merge(base: Any, patch: Any) -> Any:
    """Strategic merge of `patch` onto `base` (see the module docstring)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = merge(base.get(key), value) if key in base else value
        return merged
    if isinstance(base, list) and isinstance(patch, list) and _named(base) and _named(patch):
        merged_list = [copy.deepcopy(item) for item in base]
        index = {item["name"]: i for i, item in enumerate(merged_list)}
        for item in patch:
            if item["name"] in index:
                merged_list[index[item["name"]]] = merge(merged_list[index[item["name"]]], item)
            else:
                merged_list.append(item)
        return merged_list
    return patch


def _named(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(i, dict) and "name" in i for i in items)


def render(folder: Path) -> list[Doc]:
    """The documents `kubectl apply -k folder` would apply."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KNOWN_KEYS
    assert not unknown, f"{folder}: the test's renderer does not apply {sorted(unknown)}"
    docs: list[Doc] = []
    for resource in kustomization.get("resources", []):
        path = folder / resource
        if path.is_dir():
            docs += render(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for entry in kustomization.get("patches", []):
        assert set(entry) == {"path"}, f"{folder}: only file patches are rendered: {entry}"
        patch = yaml.safe_load((folder / entry["path"]).read_text())
        targets = [i for i, d in enumerate(docs) if _key(d) == _key(patch)]
        assert len(targets) == 1, f"{folder}: patch {entry['path']} matches {len(targets)}"
        docs[targets[0]] = merge(docs[targets[0]], patch)
    for image in kustomization.get("images", []):
        docs = [_set_image(doc, image) for doc in docs]
    return docs


def _key(doc: Doc) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def _set_image(doc: Doc, image: dict[str, str]) -> Doc:
    if doc["kind"] != "Deployment":
        return doc
    doc = copy.deepcopy(doc)
    for container in doc["spec"]["template"]["spec"]["containers"]:
        name, _, tag = container["image"].partition(":")
        if name == image["name"]:
            new_tag = image.get("newTag", tag)
            container["image"] = image.get("newName", name) + (f":{new_tag}" if new_tag else "")
    return doc


def _one(docs: list[Doc], kind: str) -> Doc:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def _container(docs: list[Doc]) -> Doc:
    (container,) = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


@pytest.fixture(params=sorted(KUSTOMIZATIONS), scope="module")
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[Doc]]:
    return request.param, render(KUSTOMIZATIONS[request.param])


def test_every_object_validates_against_the_kubernetes_schemas(
    rendered: tuple[str, list[Doc]],
) -> None:
    _, docs = rendered
    assert {d["kind"] for d in docs} == {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
    }
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validator_rejects_a_broken_deployment() -> None:
    broken = merge(render(KUSTOMIZATIONS["base"])[0], {"spec": {"replicas": "two"}})
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_probes_ask_the_launchers_port_and_health_route(rendered: tuple[str, list[Doc]]) -> None:
    name, docs = rendered
    container = _container(docs)
    image = parse(DOCKERFILES["cpu" if name == "cpu" else "gpu"])
    config = launcher.parse_args(container["args"], env=image.env)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": config.port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert (get["path"], ports[get["port"]]) == ("/health", config.port)
    assert "/health" in OPEN_PATHS, "probes carry no API key"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "room to load a model"
    service = _one(docs, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    annotations = _one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(config.port)
    assert annotations["prometheus.io/path"] == "/metrics"
    assert "/metrics" in OPEN_WHILE_DRAINING, "scrapes still answer while draining"


def test_the_grace_period_covers_the_drain(rendered: tuple[str, list[Doc]]) -> None:
    _, docs = rendered
    config = launcher.parse_args(_container(docs)["args"], env={})
    grace = _one(docs, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    needed = (
        config.graceful_termination_timeout
        + launcher.ROUTER_EXIT_MARGIN_S
        + launcher.SHARD_EXIT_TIMEOUT_S
    )
    assert grace >= needed


def test_gpus_match_the_shards_and_the_cpu_overlay_has_none() -> None:
    base = _container(render(KUSTOMIZATIONS["base"]))
    num_shard = launcher.parse_args(base["args"], env={}).num_shard
    for kind in ("requests", "limits"):
        assert base["resources"][kind]["nvidia.com/gpu"] == str(num_shard)
    cpu_docs = render(KUSTOMIZATIONS["cpu"])
    cpu = _container(cpu_docs)
    assert "nvidia.com/gpu" not in str(cpu["resources"])
    assert "tolerations" not in _one(cpu_docs, "Deployment")["spec"]["template"]["spec"]
    assert (base["image"], cpu["image"]) == ("textgate:latest", "textgate-cpu:latest")
    assert cpu["args"] == base["args"] and cpu["startupProbe"] == base["startupProbe"]


def test_selectors_pick_the_pods_and_the_hpa_scales_on_a_real_metric(
    rendered: tuple[str, list[Doc]],
) -> None:
    _, docs = rendered
    deployment = _one(docs, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert _one(docs, "Service")["spec"]["selector"].items() <= labels.items()
    pdb = _one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = _one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert f"\n{name} " in Metrics().render().decode(), f"the router exports no {name}"


def test_merge_follows_strategic_merge_rules() -> None:
    base = {"a": {"b": 1, "c": 2}, "items": [{"name": "x", "v": 1}], "plain": [1, 2]}
    patch = {"a": {"c": None, "d": 3}, "items": [{"name": "x", "w": 2}, {"name": "y"}]}
    assert merge(base, {**patch, "plain": [3]}) == {
        "a": {"b": 1, "d": 3},
        "items": [{"name": "x", "v": 1, "w": 2}, {"name": "y"}],
        "plain": [3],
    }
