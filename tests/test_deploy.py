"""deploy/: each kustomization rendered here (no kubectl on these machines), checked against
the Kubernetes schemas kubernetes-validate bundles (offline), and against the launcher:
probe paths and ports, GPUs per shard, the drain's grace period, the HPA's metric.

Custom resources (InferencePool, InferenceObjective, LeaderWorkerSet) are checked against
the CRDs vendored in tests/fixtures/crds/ (upstream versions in their headers): each
openAPIV3Schema as a JSON schema, unknown fields refused as `kubectl apply`'s strict field
validation does (CEL rules are not evaluated); a LeaderWorkerSet's pod templates against
the Kubernetes schemas.

The renderer handles what deploy/ uses of kustomize: `resources` (files and
kustomization folders), `images` (newName / newTag), and `patches` that are
strategic-merge patches by kind and name (maps merge, null deletes a key, lists of named
items merge by name, other lists are replaced). Any other kustomization key fails the test.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from textgate import launcher
from textgate.launcher_flags import FLAGS
from textgate.router.app import OPEN_PATHS
from textgate.router.http.drain import OPEN_WHILE_DRAINING
from textgate.router.metrics import Metrics
from textgate.tests.test_docker import DOCKERFILES, parse

DEPLOY = Path(launcher.__file__).parent / "deploy"
KUSTOMIZATIONS = {"base": DEPLOY / "base", "cpu": DEPLOY / "overlays" / "cpu"}
GATEWAY, MULTINODE = DEPLOY / "inference-gateway", DEPLOY / "multinode"
CRDS = Path(__file__).parent / "fixtures" / "crds"
LWS_ENV = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}
"""What the LWS controller sets in every container of a group (its api/leaderworkerset/v1)."""
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


def _strict(schema: Any) -> Any:
    """A CRD's openAPIV3Schema as a JSON schema that refuses fields it does not declare."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _strict(value) for key, value in schema.items()}
    declared = "properties" in schema and "additionalProperties" not in schema
    if declared and not schema.get("x-kubernetes-preserve-unknown-fields"):
        strict["additionalProperties"] = False
    return strict


def _crd_schemas() -> dict[tuple[str, str], Doc]:
    """(apiVersion, kind) -> the JSON schema of each served version of each vendored CRD."""
    schemas = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        for version in crd["spec"]["versions"]:
            if version["served"]:
                key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                schemas[key] = _strict(version["schema"]["openAPIV3Schema"])
    return schemas


CRD_SCHEMAS = _crd_schemas()


def validate(doc: Doc) -> None:
    """A core object against the Kubernetes schemas, a custom one against its CRD."""
    schema = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if schema is None:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        return
    jsonschema.Draft7Validator(schema).validate(doc)
    if doc["kind"] == "LeaderWorkerSet":  # its pod templates: core/v1 PodTemplateSpec
        templates = doc["spec"]["leaderWorkerTemplate"]
        for role in ("leaderTemplate", "workerTemplate"):
            if role in templates:
                pod_template = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": f"{doc['metadata']['name']}-{role}"},
                    "template": templates[role],
                }
                kubernetes_validate.validate(pod_template, KUBERNETES_VERSION, strict=True)


def test_the_vendored_crds_are_the_kinds_deploy_uses() -> None:
    assert set(CRD_SCHEMAS) == {
        ("inference.networking.k8s.io/v1", "InferencePool"),
        ("llm-d.ai/v1alpha2", "InferenceObjective"),
        ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
    }


@pytest.mark.parametrize(
    ("folder", "kinds"),
    [
        (GATEWAY, {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
                   "InferencePool", "InferenceObjective"}),
        (MULTINODE, {"LeaderWorkerSet", "Service"}),
    ],
)  # fmt: skip
def test_gateway_and_multinode_objects_validate(folder: Path, kinds: set[str]) -> None:
    docs = render(folder)
    assert {d["kind"] for d in docs} == kinds
    for doc in docs:
        validate(doc)


BROKEN = {
    "a misspelled InferencePool field": ("InferencePool", {"spec": {"targetPort": [80]}}),
    "an InferencePool without targetPorts": ("InferencePool", {"spec": {"targetPorts": None}}),
    "a port out of range": ("InferencePool", {"spec": {"targetPorts": [{"number": 70000}]}}),
    "an InferenceObjective without poolRef": ("InferenceObjective", {"spec": {"poolRef": None}}),
    "a string priority": ("InferenceObjective", {"spec": {"priority": "high"}}),
    "a misspelled LWS field": ("LeaderWorkerSet", {"spec": {"leaderWorkerTemplate": {"sise": 2}}}),
    "an unknown restart policy": (
        "LeaderWorkerSet",
        {"spec": {"leaderWorkerTemplate": {"restartPolicy": "Sometimes"}}},
    ),
    "a broken LWS pod template": (
        "LeaderWorkerSet",
        {"spec": {"leaderWorkerTemplate": {"workerTemplate": {"spec": {"containers": "x"}}}}},
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_the_validators_reject_broken_custom_resources(case: str) -> None:
    kind, patch = BROKEN[case]
    doc = next(d for d in render(GATEWAY) + render(MULTINODE) if d["kind"] == kind)
    validate(doc)
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(merge(doc, patch))


def test_the_pool_is_the_deployments_pods_on_the_launchers_port() -> None:
    docs = render(GATEWAY)
    labels = _one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    pool = _one(docs, "InferencePool")
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port = launcher.parse_args(_container(docs)["args"], env={}).port
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [port]
    group = pool["apiVersion"].split("/")[0]
    objectives = [d for d in docs if d["kind"] == "InferenceObjective"]
    assert len(objectives) == 2
    for objective in objectives:
        ref = objective["spec"]["poolRef"]
        assert (ref["group"], ref["kind"], ref["name"]) == (group, "InferencePool", "textgate")


def _lws_containers(docs: list[Doc]) -> dict[str, Doc]:
    templates = _one(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    found = {}
    for role in ("leaderTemplate", "workerTemplate"):
        (container,) = templates[role]["spec"]["containers"]
        found[role] = container
    return found


def _expanded(args: list[str], env: dict[str, str]) -> list[str]:
    """`args` with each `$(VAR)` replaced by `env[VAR]`, as Kubernetes expands them."""
    for name, value in env.items():
        args = [arg.replace(f"$({name})", value) for arg in args]
    return args


def _lws_env(worker_index: int, size: int) -> dict[str, str]:
    """What the LWS controller sets in the pod of `worker_index` (0 = the leader)."""
    return {
        "LWS_LEADER_ADDRESS": "textgate-multinode-0.textgate-multinode.default",
        "LWS_GROUP_SIZE": str(size),
        "LWS_WORKER_INDEX": str(worker_index),
    }


def test_multinode_pods_pass_lws_env_to_launcher_flags() -> None:
    docs = render(MULTINODE)
    containers = _lws_containers(docs)
    leader, worker = containers["leaderTemplate"], containers["workerTemplate"]
    for container in (leader, worker):
        args = container["args"]
        flags = dict(zip(args[::2], args[1::2], strict=True))
        assert flags["--nnodes"] == "$(LWS_GROUP_SIZE)"
        assert flags["--node-rank"] == "$(LWS_WORKER_INDEX)"
        assert flags["--master-addr"] == "$(LWS_LEADER_ADDRESS)"
        referenced = {a[2:-1] for a in args if a.startswith("$(")}
        assert referenced <= LWS_ENV, "only variables LWS sets"
    nodes = _one(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["size"]
    for index, container in [(0, leader)] + [(i, worker) for i in range(1, nodes)]:
        lws = _lws_env(index, nodes)
        config = launcher.parse_args(_expanded(container["args"], lws), env={})
        assert (config.nnodes, config.node_rank) == (nodes, index)
        assert config.master_addr == lws["LWS_LEADER_ADDRESS"]
        assert config.headless == (index > 0), "the leader runs the router, workers do not"
        # Without the flags the launcher reads LWS's env itself: the same settings.
        bare = _without(container["args"], {"--nnodes", "--node-rank", "--master-addr"})
        assert launcher.parse_args(bare, env=lws) == config
        # --num-shard is the whole tensor-parallel size, split evenly over the group's nodes.
        assert config.shards_per_node * nodes == config.num_shard
        for kind in ("requests", "limits"):
            gpus = container["resources"][kind]["nvidia.com/gpu"]
            assert gpus == str(config.shards_per_node)
        # Rank r listens on --shard-port + r: the node's ranks' ports are declared.
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["shards"] == config.shard_port + config.node_ranks.start
    # A worker's flags are the leader's less the router's.
    assert worker["args"] == leader["args"][: len(worker["args"])]
    config = launcher.parse_args(_expanded(leader["args"], _lws_env(0, nodes)), env={})
    ports = {p["name"]: p["containerPort"] for p in leader["ports"]}
    assert ports == {"http": config.port, "rendezvous": config.master_port, "shards": 29600}
    for probe in ("startupProbe", "readinessProbe"):
        assert leader[probe]["httpGet"] == {"path": "/health", "port": "http"}
    service = _one(docs, "Service")
    lws = _one(docs, "LeaderWorkerSet")
    leader_labels = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"]
    selector = dict(service["spec"]["selector"])
    assert selector.pop("leaderworkerset.sigs.k8s.io/name") == lws["metadata"]["name"]
    assert selector.items() <= leader_labels.items() and selector
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def _without(args: list[str], names: set[str]) -> list[str]:
    """`args` less the flags `names` and their values."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        else:
            kept.append(arg)
    return kept


def test_the_multinode_flags_are_documented_with_what_lws_sets() -> None:
    """deploy/README.md's table: each multi-node flag, the LWS variable it reads, and no
    pending note left from before the launcher had them."""
    existing = {f"--{flag.name}" for flag in FLAGS}
    readme = (DEPLOY / "README.md").read_text()
    assert "pending" not in readme.lower()
    for name, lws in [
        ("--nnodes", "LWS_GROUP_SIZE"),
        ("--node-rank", "LWS_WORKER_INDEX"),
        ("--master-addr", "LWS_LEADER_ADDRESS"),
    ]:
        assert name in existing
        (flag,) = [f for f in FLAGS if f"--{f.name}" == name]
        assert lws in flag.env, f"{name} falls back to {lws}"
        assert f"| `{name}` | `$({lws})`" in readme
    for path in MULTINODE.glob("*.yaml"):
        assert "pending" not in path.read_text().lower(), path
