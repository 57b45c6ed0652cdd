"""The deployment artefacts agree with each other and with the code.

config/*.toml load with the real loader; the Kubernetes manifests parse and agree on names,
labels, namespace, ports, the ConfigMap key and mount path, probe paths and the shutdown
timeline; the Role grants only reads of pods; the Containerfile copies files that exist and runs
the console script pyproject.toml declares. The endpoint-picker component (config/kubernetes/
picker/) renders objects valid against the Kubernetes schema or, for the InferencePool and the
example's Gateway and HTTPRoute, against the upstream CRDs in tests/fixtures/crds/, and agrees
with the base on ports, probes, engines and router.toml. Static checks only: no cluster, no
container engine.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # kubernetes-validate's dependency
import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from trio_router import __version__
from trio_router.config import Config, config_as_dict, load_config, parse_bind, parse_config
from trio_router.limits.redis import RedisURL

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "config"
MANIFEST_DIR = CONFIG_DIR / "kubernetes"
CONTAINERFILE = REPO / "Containerfile"
OPERATIONS_DOC = REPO / "README.md"  # the config reference lives in the README

# Keys of config/router.toml allowed to differ from the built-in defaults, and why.
ROUTER_TOML_NON_DEFAULTS = {
    "discovery.kubernetes.namespace": "the router's own namespace, where its engines are",
}
CLUSTER_BIND = "0.0.0.0:8080"
EXIT_MARGIN_S = 2.0  # the router exits within server.drain_s + 2 s of SIGTERM
EXPECTED_KINDS = {
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "ConfigMap",
    "Deployment",
    "Service",
    "PodDisruptionBudget",
    "HorizontalPodAutoscaler",
    "NetworkPolicy",
}
KUSTOMIZATION = MANIFEST_DIR / "kustomization.yaml"


# --- helpers ------------------------------------------------------------------------------


def flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value for every leaf of a nested TOML table (an empty table, like
    `routing.aliases`, is a leaf)."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{path}."))
        else:
            out[path] = value
    return out


DEFAULTS = flatten(config_as_dict(Config()))


def kustomization() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(KUSTOMIZATION.read_text(encoding="utf-8"))
    return doc


def rendered() -> list[dict[str, Any]]:
    """The objects `kubectl apply -k config/kubernetes` would create: `kubectl kustomize`
    when kubectl is installed, else the same transformation the base uses (the namespace on
    every object and on the RoleBinding's ServiceAccount subject, the image tag)."""
    if kubectl := shutil.which("kubectl"):
        out = subprocess.run(
            [kubectl, "kustomize", str(MANIFEST_DIR)],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        return [d for d in yaml.safe_load_all(out) if d]
    kust = kustomization()
    docs = []
    for name in kust["resources"]:
        for doc in yaml.safe_load_all((MANIFEST_DIR / name).read_text(encoding="utf-8")):
            if not doc:
                continue
            doc["metadata"]["namespace"] = kust["namespace"]
            for subject in doc.get("subjects", []):
                if subject["kind"] == "ServiceAccount":
                    subject["namespace"] = kust["namespace"]
            for container in (
                doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
            ):
                for image in kust.get("images", []):
                    if container["image"].rsplit(":", 1)[0] == image["name"]:
                        container["image"] = f"{image['name']}:{image['newTag']}"
            docs.append(doc)
    return docs


def manifests() -> dict[str, dict[str, Any]]:
    """Every object under config/kubernetes/, by kind; a kind appearing twice is an error."""
    objects: dict[str, dict[str, Any]] = {}
    for path in sorted(MANIFEST_DIR.glob("*.y*ml")):
        if path == KUSTOMIZATION:
            continue
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc is None:
                continue
            assert isinstance(doc, dict), f"{path.name}: not a mapping"
            kind = doc["kind"]
            assert kind not in objects, f"{path.name}: a second {kind}"
            objects[kind] = doc
    return objects


@pytest.fixture(scope="module")
def objs() -> dict[str, dict[str, Any]]:
    return manifests()


def pod_spec(objs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = objs["Deployment"]["spec"]["template"]["spec"]
    return spec


def router_container(objs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    containers = pod_spec(objs)["containers"]
    assert len(containers) == 1, "one container per router pod"
    container: dict[str, Any] = containers[0]
    return container


def cluster_config(objs: dict[str, dict[str, Any]]) -> Config:
    """The Config the pods run: the ConfigMap's router.toml through the real parser."""
    text = objs["ConfigMap"]["data"]["router.toml"]
    return parse_config(tomllib.loads(text), source="ConfigMap router.toml")


def config_arg(container: dict[str, Any]) -> str:
    args: list[str] = container["args"]
    assert args[0] == "--config" and len(args) == 2, args
    return args[1]


def named_port(container: dict[str, Any], port: int | str) -> int:
    """Resolve a probe or Service port (number or name) to the container port number."""
    if isinstance(port, int):
        return port
    matches = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    assert len(matches) == 1, f"no container port named {port!r}"
    number: int = matches[0]
    return number


def prestop_sleep_s(container: dict[str, Any]) -> float:
    """Seconds the preStop hook pauses: `exec: sleep N` or the `sleep` lifecycle action."""
    pre_stop = container["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        return float(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert len(command) == 2 and command[0] == "sleep", f"preStop is not a plain sleep: {command}"
    return float(command[1])


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based label selector semantics ("a=b,c!=d"), as the API server applies them."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        else:
            raise AssertionError(f"set-based selector term {term!r} is not handled here")
    return True


def containerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in CONTAINERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        pending = ""
    assert not pending, "Containerfile ends inside a line continuation"
    return instructions


def stages() -> list[list[tuple[str, str]]]:
    """The Containerfile's build stages, each starting with its FROM."""
    out: list[list[tuple[str, str]]] = []
    for keyword, rest in containerfile_instructions():
        if keyword == "FROM":
            out.append([])
        assert out, f"{keyword} before the first FROM"
        out[-1].append((keyword, rest))
    return out


def exec_form(instructions: list[tuple[str, str]], keyword: str) -> list[str]:
    """The JSON (exec) form of the last `keyword` instruction."""
    values = [rest for kw, rest in instructions if kw == keyword]
    assert values, f"no {keyword} in the Containerfile"
    parsed = json.loads(values[-1])
    assert isinstance(parsed, list) and all(isinstance(v, str) for v in parsed), (
        f"{keyword} must use the exec (JSON) form, got {values[-1]}"
    )
    return parsed


def copy_arguments(rest: str) -> tuple[list[str], list[str], str]:
    """Split a COPY's arguments into (flags, sources, destination)."""
    words = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
    flags = [w for w in words if w.startswith("--")]
    paths = [w for w in words if not w.startswith("--")]
    assert len(paths) >= 2, f"COPY needs a source and a destination: {rest}"
    return flags, paths[:-1], paths[-1]


def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def toml_files() -> Iterator[Path]:
    return iter(sorted(CONFIG_DIR.rglob("*.toml")))


# --- TOML ---------------------------------------------------------------------------------


def test_config_directory_has_the_documented_examples() -> None:
    names = {p.name for p in toml_files()}
    assert {"router.toml", "demo.toml", "static.toml"} <= names


@pytest.mark.parametrize("path", list(toml_files()), ids=lambda p: str(p.relative_to(REPO)))
def test_every_toml_under_config_loads(path: Path) -> None:
    config = load_config(path)
    parse_bind(config.server.bind)  # raises on a malformed bind
    assert config.discovery.mode in ("static", "kubernetes")


def test_router_toml_lists_every_key_with_its_default_and_a_comment() -> None:
    path = CONFIG_DIR / "router.toml"
    text = path.read_text(encoding="utf-8")
    raw = flatten(tomllib.loads(text))
    assert set(raw) == set(DEFAULTS), (
        f"missing {sorted(set(DEFAULTS) - set(raw))}, extra {sorted(set(raw) - set(DEFAULTS))}"
    )

    effective = flatten(config_as_dict(load_config(path)))
    differing = {k for k in DEFAULTS if effective[k] != DEFAULTS[k]}
    assert differing == set(ROUTER_TOML_NON_DEFAULTS), differing
    assert load_config(path).discovery.mode == "kubernetes"

    for line in text.splitlines():
        if re.match(r"^[a-z_]+\s*=", line):
            assert "#" in line, f"router.toml: no comment on {line!r}"


def test_demo_toml_is_static_on_loopback() -> None:
    config = load_config(CONFIG_DIR / "demo.toml")
    assert config.discovery.mode == "static"
    host, _ = parse_bind(config.server.bind)
    assert host.startswith("127.")
    assert config.discovery.static.urls
    assert all(e.url.startswith("http://127.") for e in config.discovery.static.urls)


def test_static_toml_is_static_with_engines() -> None:
    config = load_config(CONFIG_DIR / "static.toml")
    assert config.discovery.mode == "static"
    assert len(config.discovery.static.urls) >= 2


# --- manifests ----------------------------------------------------------------------------


def test_manifests_hold_exactly_the_expected_objects(objs: dict[str, dict[str, Any]]) -> None:
    assert set(objs) == EXPECTED_KINDS  # notably no ClusterRole or ClusterRoleBinding


def test_the_namespace_is_set_in_one_place(objs: dict[str, dict[str, Any]]) -> None:
    """kustomization.yaml names the namespace; no manifest does, and the router watches its
    own namespace, so the engines are found wherever the base is deployed."""
    assert cluster_config(objs).discovery.kubernetes.namespace == ""
    for kind, obj in objs.items():
        assert "namespace" not in obj["metadata"], kind
    namespace = kustomization()["namespace"]
    docs = rendered()
    assert {d["kind"] for d in docs} == EXPECTED_KINDS
    for doc in docs:
        assert doc["metadata"]["namespace"] == namespace, doc["kind"]
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    assert binding["subjects"][0]["namespace"] == namespace


def test_rendered_objects_are_strictly_valid() -> None:
    """Every object `kubectl apply -k` would create is valid against the Kubernetes schema,
    unknown fields rejected."""
    for doc in rendered():
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


COMPONENT_DIR = MANIFEST_DIR / "components" / "shared-limits"


def component_docs(name: str) -> list[dict[str, Any]]:
    text = (COMPONENT_DIR / name).read_text(encoding="utf-8")
    return [d for d in yaml.safe_load_all(text) if d]


def test_the_shared_limits_component_is_the_base_with_a_store(
    objs: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """components/shared-limits: its router.toml is the base's with store = "redis"; the
    URL the routers get names the store's Service; its objects are strictly valid; and
    `kubectl kustomize` of an overlay with it renders all of that (when kubectl is here)."""
    base_toml = objs["ConfigMap"]["data"]["router.toml"]
    (patch,) = component_docs("configmap-patch.yaml")
    assert patch["data"]["router.toml"] == base_toml.replace('store = "local"', 'store = "redis"')
    config = parse_config(tomllib.loads(patch["data"]["router.toml"]))
    assert config.limits.store == "redis"
    (deployment_patch,) = component_docs("deployment-patch.yaml")
    (container,) = deployment_patch["spec"]["template"]["spec"]["containers"]
    (env,) = container["env"]
    assert env["name"] == config.limits.redis_url_env
    url = RedisURL.parse(env["value"])
    store = {d["kind"]: d for d in component_docs("redis.yaml")}
    assert url.host == store["Service"]["metadata"]["name"]
    assert url.port == store["Service"]["spec"]["ports"][0]["port"]
    for doc in store.values():
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    if (kubectl := shutil.which("kubectl")) is None:
        return
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        f"namespace: {kustomization()['namespace']}\n"
        f"resources: [{os.path.relpath(MANIFEST_DIR, overlay)}]\n"
        f"components: [{os.path.relpath(COMPONENT_DIR, overlay)}]\n"
    )
    out = subprocess.run(
        [kubectl, "kustomize", str(overlay)], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    router = by_name["Deployment", "trio-router"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": env["name"], "value": env["value"]} in router["env"]
    rendered_toml = by_name["ConfigMap", "trio-router-config"]["data"]["router.toml"]
    assert parse_config(tomllib.loads(rendered_toml)).limits.store == "redis"
    egress = by_name["NetworkPolicy", "trio-router"]["spec"]["egress"]
    assert any(p["port"] == url.port for rule in egress for p in rule.get("ports", []))
    assert {d["metadata"]["namespace"] for d in docs} == {kustomization()["namespace"]}
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_the_disaggregated_engines_example_is_valid_and_labelled_by_role(
    objs: dict[str, dict[str, Any]],
) -> None:
    path = MANIFEST_DIR / "examples" / "vllm-disaggregated.yaml"
    docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
    config = cluster_config(objs)
    selector = dict(
        term.split("=", 1) for term in config.discovery.kubernetes.label_selector.split(",")
    )
    roles = set()
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()  # the router discovers them
        roles.add(config.disaggregation.role_of(labels))
        (container,) = doc["spec"]["template"]["spec"]["containers"]
        transfer = next(a for a in container["args"] if a.startswith("--kv-transfer-config="))
        assert json.loads(transfer.partition("=")[2])["kv_connector"] == "NixlConnector"
        env = {e["name"]: e for e in container["env"]}
        side = env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert side == "status.podIP"
        ports = {p["containerPort"] for p in container["ports"]}
        assert {config.discovery.kubernetes.port, config.kv_events.port} <= ports
    assert roles == {"prefill", "decode"}


def test_autoscaler_and_network_policy_fit_the_deployment(objs: dict[str, dict[str, Any]]) -> None:
    hpa, deployment = objs["HorizontalPodAutoscaler"], objs["Deployment"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] >= objs["PodDisruptionBudget"]["spec"]["minAvailable"] + 1
    policy = objs["NetworkPolicy"]["spec"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    container = router_container(objs)
    bind_port = parse_bind(cluster_config(objs).server.bind)[1]
    assert [p["port"] for p in policy["ingress"][0]["ports"]] == [bind_port]
    engine_port = cluster_config(objs).discovery.kubernetes.port
    egress_ports = {p["port"] for rule in policy["egress"] for p in rule.get("ports", [])}
    assert {engine_port, 443, 53} <= egress_ports
    # kv_aware subscribes to every engine's KV-event publisher (and replay endpoint: 5558).
    assert {cluster_config(objs).kv_events.port, 5558} <= egress_ports
    spread = {c["topologyKey"] for c in pod_spec(objs)["topologySpreadConstraints"]}
    assert spread == {"topology.kubernetes.io/zone", "kubernetes.io/hostname"}
    assert container["resources"]["requests"]["cpu"]  # the HPA's utilization is of this


def test_configmap_is_router_toml_with_a_cluster_bind(objs: dict[str, dict[str, Any]]) -> None:
    text = objs["ConfigMap"]["data"]["router.toml"]
    assert set(flatten(tomllib.loads(text))) == set(DEFAULTS), "the ConfigMap lists every key"

    cluster = flatten(config_as_dict(cluster_config(objs)))
    example = flatten(config_as_dict(load_config(CONFIG_DIR / "router.toml")))
    assert cluster["server.bind"] == CLUSTER_BIND
    differing = {k for k in example if cluster[k] != example[k]}
    assert differing == {"server.bind"}, differing


def test_config_mount_path_agrees_everywhere(objs: dict[str, dict[str, Any]]) -> None:
    spec, container = pod_spec(objs), router_container(objs)
    volumes = {v["name"]: v for v in spec["volumes"]}
    (mount,) = [
        m
        for m in container["volumeMounts"]
        if volumes[m["name"]].get("configMap", {}).get("name")
        == objs["ConfigMap"]["metadata"]["name"]
    ]
    assert "subPath" not in mount, "a subPath mount never sees ConfigMap updates"
    items = volumes[mount["name"]]["configMap"]["items"]
    assert [i["key"] for i in items] == ["router.toml"]
    mounted = str(PurePosixPath(mount["mountPath"]) / items[0]["path"])

    assert mounted == "/etc/trio-router/router.toml"
    assert config_arg(container) == mounted
    assert exec_form(stages()[-1], "CMD") == ["--config", mounted]


def test_ports_agree(objs: dict[str, dict[str, Any]]) -> None:
    container = router_container(objs)
    _, bind_port = parse_bind(cluster_config(objs).server.bind)
    service_ports = objs["Service"]["spec"]["ports"]
    assert len(service_ports) == 1
    assert named_port(container, service_ports[0]["targetPort"]) == bind_port
    assert [p["containerPort"] for p in container["ports"]] == [bind_port]
    exposed = [rest for kw, rest in stages()[-1] if kw == "EXPOSE"]
    assert exposed == [str(bind_port)]
    annotations = objs["Deployment"]["spec"]["template"]["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/port", str(bind_port)) == str(bind_port)


def test_probes_readiness_on_health_liveness_not(objs: dict[str, dict[str, Any]]) -> None:
    container = router_container(objs)
    _, bind_port = parse_bind(cluster_config(objs).server.bind)

    readiness = container["readinessProbe"]
    assert readiness["httpGet"]["path"] == "/health"
    assert named_port(container, readiness["httpGet"]["port"]) == bind_port

    liveness = container["livenessProbe"]
    if "httpGet" in liveness:
        # /health follows the API server; restarting on it would restart every replica at once.
        assert liveness["httpGet"]["path"] != "/health"
        assert liveness["httpGet"]["path"] in ("/metrics", "/engines", "/v1/models")
        assert named_port(container, liveness["httpGet"]["port"]) == bind_port
    else:
        assert named_port(container, liveness["tcpSocket"]["port"]) == bind_port
    # A restart needs at least 30 s of consecutive failures: one slow event-loop turn never kills.
    assert liveness.get("failureThreshold", 3) * liveness.get("periodSeconds", 10) >= 30


def test_grace_period_covers_prestop_and_drain(objs: dict[str, dict[str, Any]]) -> None:
    spec, container = pod_spec(objs), router_container(objs)
    pause = prestop_sleep_s(container)
    drain = cluster_config(objs).server.drain_s
    assert pause > 0
    assert spec["terminationGracePeriodSeconds"] > drain + pause
    assert spec["terminationGracePeriodSeconds"] >= drain + pause + EXIT_MARGIN_S


ENGINE_EXIT_MARGIN_S = 10.0  # a vLLM engine's own exit after its drain (freeing the GPU)


def engine_deployments() -> list[tuple[str, dict[str, Any]]]:
    """Every vLLM engine Deployment of the examples, with the file it is in."""
    found = []
    for path in sorted((MANIFEST_DIR / "examples").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if not doc or doc.get("kind") != "Deployment":
                continue
            containers = doc["spec"]["template"]["spec"]["containers"]
            if any("vllm" in c["image"] for c in containers):
                found.append((f"{path.relative_to(MANIFEST_DIR)}:{doc['metadata']['name']}", doc))
    return found


def test_engine_pods_stop_after_their_streams_are_handed_over_and_drained() -> None:
    """Every engine Deployment of the examples stops cleanly (docs/operations.md, "Engine
    rollouts and graceful termination"): a preStop sleep, so the routers see the pod
    terminating and hand its streams over before vLLM hears of it; vLLM's
    --shutdown-timeout, so what cannot be handed over finishes; and a grace period longer
    than both together, with room for the engine's own exit."""
    engines = engine_deployments()
    assert len(engines) >= 3  # autoscaling/engine, the disaggregated prefill and decode
    for where, doc in engines:
        spec = doc["spec"]["template"]["spec"]
        (container,) = [c for c in spec["containers"] if "vllm" in c["image"]]
        pause = prestop_sleep_s(container)
        timeouts = [a for a in container["args"] if a.startswith("--shutdown-timeout=")]
        assert len(timeouts) == 1, f"{where}: no --shutdown-timeout=N"
        drain = float(timeouts[0].partition("=")[2])
        assert pause > 0 and drain > 0, where
        grace = spec["terminationGracePeriodSeconds"]
        assert grace > pause + drain, where
        assert grace >= pause + drain + ENGINE_EXIT_MARGIN_S, where


def test_labels_and_selectors_agree(objs: dict[str, dict[str, Any]]) -> None:
    deployment = objs["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert objs["Service"]["spec"]["selector"] == selector
    assert objs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == selector
    for kind, obj in objs.items():
        assert obj["metadata"]["labels"].items() <= pod_labels.items(), kind
    # The router's own pods must never be discovered as engines.
    engines = cluster_config(objs).discovery.kubernetes.label_selector
    assert not selector_matches(engines, pod_labels)
    assert selector_matches(engines, {"app": "vllm"})


def test_replicas_and_disruption_budget(objs: dict[str, dict[str, Any]]) -> None:
    replicas = objs["Deployment"]["spec"]["replicas"]
    assert replicas == 2
    assert objs["PodDisruptionBudget"]["spec"]["minAvailable"] == 1
    assert objs["PodDisruptionBudget"]["spec"]["minAvailable"] < replicas


def test_service_account_is_bound_to_the_role(objs: dict[str, dict[str, Any]]) -> None:
    account = objs["ServiceAccount"]["metadata"]
    assert pod_spec(objs)["serviceAccountName"] == account["name"]
    binding = objs["RoleBinding"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": objs["Role"]["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"]},  # kustomize sets the namespace
    ]


def test_role_grants_only_reads_of_pods(objs: dict[str, dict[str, Any]]) -> None:
    role = objs["Role"]
    assert role["apiVersion"] == "rbac.authorization.k8s.io/v1"
    assert set(role) == {"apiVersion", "kind", "metadata", "rules"}  # no aggregationRule
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    ]
    assert "*" not in json.dumps(role["rules"])


def test_pod_is_locked_down(objs: dict[str, dict[str, Any]]) -> None:
    spec, container = pod_spec(objs), router_container(objs)
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == containerfile_uid() != 0
    assert spec.get("hostNetwork") is not True
    for section in ("requests", "limits"):
        assert {"cpu", "memory"} <= container["resources"][section].keys(), section


def test_image_tag_is_the_package_version(objs: dict[str, dict[str, Any]]) -> None:
    image: str = router_container(objs)["image"]
    assert image.rsplit(":", 1)[1] == __version__
    (tag,) = kustomization()["images"]
    assert tag["newTag"] == __version__ and tag["name"] == image.rsplit(":", 1)[0]


# --- endpoint picker component ------------------------------------------------------------

PICKER_DIR = MANIFEST_DIR / "picker"
GATEWAY_EXAMPLE = PICKER_DIR / "examples" / "gateway.yaml"
CRD_DIR = REPO / "tests" / "fixtures" / "crds"
PICKER_PORT = 9002  # the ext_proc port of the Inference Extension's own picker
# Kubernetes' gRPC health services the picker answers, and the one each probe asks.
PICKER_PROBES = {"livenessProbe": "liveness", "readinessProbe": "readiness"}


def picker_kustomization() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(
        (PICKER_DIR / "kustomization.yaml").read_text(encoding="utf-8")
    )
    return doc


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    """Apply RFC 6902 operations (add, replace, remove) to `doc` in place."""
    for op in ops:
        *parents, last = [
            t.replace("~1", "/").replace("~0", "~") for t in op["path"].split("/")[1:]
        ]
        node: Any = doc
        for token in parents:
            node = node[int(token)] if isinstance(node, list) else node[token]
        if isinstance(node, list):
            if op["op"] == "add":
                node.insert(len(node) if last == "-" else int(last), op["value"])
            elif op["op"] == "replace":
                node[int(last)] = op["value"]
            else:
                assert op["op"] == "remove", op
                del node[int(last)]
        elif op["op"] == "remove":
            del node[last]
        else:
            assert op["op"] == "add" or (op["op"] == "replace" and last in node), op
            node[last] = op["value"]


def merge_maps(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """A strategic merge patch made of maps only: keys merged, values replaced."""
    for key, value in patch.items():
        assert not isinstance(value, list), f"{key}: lists need merge keys, not handled here"
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            merge_maps(target[key], value)
        else:
            target[key] = value


def with_picker(base: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The base's rendered objects with the picker component applied, as kustomize does for
    an overlay listing it: its resources added in the base's namespace, its patches applied."""
    docs = copy.deepcopy(base)
    kust = picker_kustomization()
    namespace = kustomization()["namespace"]
    for name in kust["resources"]:
        for doc in yaml_docs(PICKER_DIR / name):
            doc["metadata"]["namespace"] = namespace
            docs.append(doc)
    for patch in kust["patches"]:
        text = patch.get("patch") or (PICKER_DIR / patch["path"]).read_text(encoding="utf-8")
        content = yaml.safe_load(text)
        if "target" in patch:
            target = patch["target"]
            (doc,) = [
                d
                for d in docs
                if (d["kind"], d["metadata"]["name"]) == (target["kind"], target["name"])
            ]
            json_patch(doc, content)
        else:
            (doc,) = [
                d
                for d in docs
                if (d["kind"], d["metadata"]["name"])
                == (content["kind"], content["metadata"]["name"])
            ]
            merge_maps(doc, content)
    return docs


def kubectl_with_picker(kubectl: str, where: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize` of an overlay of the base that lists the picker component."""
    overlay = where / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        f"namespace: {kustomization()['namespace']}\n"
        f"resources: [{os.path.relpath(MANIFEST_DIR, overlay)}]\n"
        f"components: [{os.path.relpath(PICKER_DIR, overlay)}]\n"
    )
    out = subprocess.run(
        [kubectl, "kustomize", str(overlay)], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="module")
def picker(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, Any]]:
    """The objects the base with the picker component renders, by (kind, name): `kubectl
    kustomize` when kubectl is installed, else with_picker() of the base."""
    if kubectl := shutil.which("kubectl"):
        docs = kubectl_with_picker(kubectl, tmp_path_factory.mktemp("picker"))
    else:
        docs = with_picker(rendered())
    objects = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(objects) == len(docs), "two objects of one kind and name"
    return objects


def picker_container(picker: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    (container,) = picker["Deployment", "trio-router"]["spec"]["template"]["spec"]["containers"]
    assert isinstance(container, dict)
    return container


def picker_toml_text() -> str:
    (patch,) = yaml_docs(PICKER_DIR / "configmap-patch.yaml")
    text: str = patch["data"]["router.toml"]
    return text


def the_pool(picker: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    (pool,) = [d for (kind, _), d in picker.items() if kind == "InferencePool"]
    return pool


# Custom resources: validated against their CRDs' schemas, vendored unmodified.


def crd_fixtures() -> dict[str, str]:
    """File name -> SHA-256, from the table in tests/fixtures/crds/README.md."""
    text = (CRD_DIR / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([^`]+\.yaml)` \|.*\| ([0-9a-f]{64}) \|$", text, flags=re.MULTILINE)
    return dict(rows)


@functools.cache
def crds() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the served version's entry of its CustomResourceDefinition."""
    out = {}
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # 0.6 MB of YAML
    for name in crd_fixtures():
        (crd,) = yaml.load_all((CRD_DIR / name).read_text(encoding="utf-8"), Loader=loader)
        assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["scope"] == "Namespaced"
        for version in crd["spec"]["versions"]:
            if version["served"]:
                api_version = f"{crd['spec']['group']}/{version['name']}"
                out[api_version, crd["spec"]["names"]["kind"]] = version
    return out


def closed(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with unknown fields rejected: additionalProperties false wherever an object
    lists its properties and says nothing of others. Only the structural part is closed (the
    schemas under properties, items and additionalProperties), not the branches of
    oneOf/anyOf/allOf/not, which may only restate fields the structure declares."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: closed(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    if isinstance(out.get("items"), dict):
        out["items"] = closed(out["items"])
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed(out["additionalProperties"])
    return out


def validate_custom(doc: dict[str, Any]) -> None:
    """Validate a custom resource the way `kubectl apply --validate=strict` would, but for
    its CRD's CEL rules (x-kubernetes-validations), which are not evaluated here: the served
    version's openAPIV3Schema with unknown fields rejected, and its metadata as ObjectMeta."""
    version = crds().get((doc["apiVersion"], doc["kind"]))
    assert version, f"no vendored CRD serves {doc['apiVersion']} {doc['kind']}"
    schema = version["schema"]["openAPIV3Schema"]
    validator = jsonschema.Draft4Validator(closed(schema))
    errors = [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(doc)
    ]
    assert not errors, f"{doc['kind']} {doc['metadata'].get('name')}: {errors}"
    meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}
    kubernetes_validate.validate(meta, kubernetes_validate.latest_version(), strict=True)


def test_vendored_crds_are_the_upstream_files() -> None:
    """tests/fixtures/crds/ holds exactly the files its README lists, with their digests, and
    each file is the release its row names."""
    rows = crd_fixtures()
    assert set(rows) == {p.name for p in CRD_DIR.glob("*.yaml")}
    readme = (CRD_DIR / "README.md").read_text(encoding="utf-8")
    for name, digest in rows.items():
        data = (CRD_DIR / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest, f"{name} is not the upstream file"
        (crd,) = yaml_docs(CRD_DIR / name)
        (bundle,) = [v for k, v in crd["metadata"]["annotations"].items() if "bundle-version" in k]
        assert re.search(rf"^\| `{re.escape(name)}` \|.*\| {bundle} \|", readme, re.MULTILINE)
    assert {kind for _, kind in crds()} == {"InferencePool", "Gateway", "HTTPRoute"}


def test_the_strict_crd_validation_rejects_what_the_api_server_would() -> None:
    """The validation above is not vacuous: an unknown field, a missing required one and a
    value out of range are each caught, at any depth."""
    good: dict[str, Any] = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "p"},
        "spec": {
            "selector": {"matchLabels": {"app": "vllm"}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
        },
    }
    validate_custom(good)
    for path, value in [
        ("/spec/targetPortNumber", 8000),  # v1alpha2's field
        ("/spec/endpointPickerRef/port/name", "grpc"),
        ("/spec/targetPorts/0/number", 70000),
        ("/spec/endpointPickerRef/failureMode", "FailSometimes"),
        ("/metadata/labelz", {}),
    ]:
        bad = copy.deepcopy(good)
        json_patch(bad, [{"op": "add", "path": path, "value": value}])
        with pytest.raises((AssertionError, kubernetes_validate.ValidationError)):
            validate_custom(bad)
    bad = copy.deepcopy(good)
    json_patch(bad, [{"op": "remove", "path": "/spec/selector"}])
    with pytest.raises(AssertionError, match="selector"):
        validate_custom(bad)


def test_picker_objects_are_strictly_valid(
    picker: dict[tuple[str, str], dict[str, Any]],
) -> None:
    """Every object the base with the picker renders: built-in kinds against the Kubernetes
    schema, the InferencePool against its CRD, unknown fields rejected."""
    assert {kind for kind, _ in picker} == EXPECTED_KINDS | {"InferencePool"}
    namespace = kustomization()["namespace"]
    for doc in picker.values():
        assert doc["metadata"]["namespace"] == namespace, doc["kind"]
        if (doc["apiVersion"], doc["kind"]) in crds():
            validate_custom(doc)
        else:
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    for name in picker_kustomization()["resources"]:
        for doc in yaml_docs(PICKER_DIR / name):
            assert "namespace" not in doc["metadata"], name  # the base's, set by kustomize


def test_picker_component_renders_as_emulated(tmp_path: Path) -> None:
    """with_picker(), which the tests use without kubectl, renders what kustomize does."""
    if (kubectl := shutil.which("kubectl")) is None:
        pytest.skip("kubectl is not installed")

    def key(doc: dict[str, Any]) -> str:
        return json.dumps(doc, sort_keys=True)

    assert sorted(map(key, kubectl_with_picker(kubectl, tmp_path))) == sorted(
        map(key, with_picker(rendered()))
    )


def test_picker_router_toml_is_the_base_with_the_picker_on(
    objs: dict[str, dict[str, Any]], picker: dict[tuple[str, str], dict[str, Any]]
) -> None:
    """The component's router.toml is the base's with the picker enabled on PICKER_PORT and
    discovery reading the pool, every other key alike; every key has its comment."""
    text = picker_toml_text()
    assert picker["ConfigMap", "trio-router-config"]["data"]["router.toml"] == text
    raw = flatten(tomllib.loads(text))
    base = flatten(tomllib.loads(objs["ConfigMap"]["data"]["router.toml"]))
    changes = {
        "picker.enabled": True,
        "picker.bind": f"0.0.0.0:{PICKER_PORT}",
        "discovery.kubernetes.inference_pool": the_pool(picker)["metadata"]["name"],
    }
    # Keys the base does not list (yet) are at their defaults (or, unknown to the loader yet,
    # left to test_picker_router_toml_loads); every key is listed.
    unlisted = {k: DEFAULTS.get(k, raw[k]) for k in raw.keys() - base.keys() - changes.keys()}
    expected = base | unlisted | changes
    assert raw == expected, {
        k for k in raw.keys() | expected.keys() if raw.get(k) != expected.get(k)
    }
    assert set(DEFAULTS) <= set(raw), sorted(set(DEFAULTS) - set(raw))
    for line in text.splitlines():
        if re.match(r"^\s*[a-z_]+\s*=", line):
            assert "#" in line, f"no comment on {line.strip()!r}"


@pytest.mark.skipif(
    not {"picker.enabled", "discovery.kubernetes.inference_pool"} <= DEFAULTS.keys(),
    reason="trio_router.config knows no [picker] or discovery.kubernetes.inference_pool yet",
)
def test_picker_router_toml_loads(objs: dict[str, dict[str, Any]]) -> None:
    """The pods' router.toml through the real loader: picker mode, on the port the manifests
    use, discovery from the pool; nothing else differs from the base's."""
    config = parse_config(tomllib.loads(picker_toml_text()), source="picker router.toml")
    effective = flatten(config_as_dict(config))
    assert effective["picker.enabled"] is True
    assert parse_bind(effective["picker.bind"])[1] == PICKER_PORT
    assert effective["discovery.kubernetes.inference_pool"]
    assert effective["discovery.mode"] == "kubernetes"
    base = flatten(config_as_dict(cluster_config(objs)))
    differing = {k for k in effective if effective[k] != base[k]}
    assert differing <= {"picker.enabled", "picker.bind", "discovery.kubernetes.inference_pool"}


def test_picker_ports_probes_and_services_agree(
    picker: dict[tuple[str, str], dict[str, Any]],
) -> None:
    """picker.bind's port is the container's `grpc` port, the one both gRPC probes ask (the
    health services the picker answers), the Service trio-router-epp's target and, by that
    Service's port, the pool's endpointPickerRef. The HTTP port stays, for /health and
    /metrics, and the NetworkPolicy lets both in."""
    container = picker_container(picker)
    raw = tomllib.loads(picker_toml_text())
    grpc_port = parse_bind(raw["picker"]["bind"])[1]
    http_port = parse_bind(raw["server"]["bind"])[1]
    assert grpc_port == PICKER_PORT
    assert named_port(container, "grpc") == grpc_port
    assert named_port(container, "http") == http_port
    assert sorted(p["containerPort"] for p in container["ports"]) == sorted([http_port, grpc_port])
    for probe, service in PICKER_PROBES.items():
        assert container[probe]["grpc"] == {"port": grpc_port, "service": service}, probe
        assert not {"httpGet", "tcpSocket", "exec"} & container[probe].keys(), probe
    liveness = container["livenessProbe"]
    assert liveness["failureThreshold"] * liveness["periodSeconds"] >= 30

    deployment = picker["Deployment", "trio-router"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    epp = picker["Service", "trio-router-epp"]
    assert epp["spec"]["selector"] == selector
    (port,) = epp["spec"]["ports"]
    assert named_port(container, port["targetPort"]) == grpc_port
    assert port["appProtocol"] == "kubernetes.io/h2c"  # gRPC without TLS
    ref = the_pool(picker)["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    assert ref["name"] == epp["metadata"]["name"]
    assert ref["port"] == {"number": port["port"]}  # CEL: a Service reference needs its port
    assert ref.get("failureMode", "FailClose") in ("FailClose", "FailOpen")

    http = picker["Service", "trio-router"]["spec"]["ports"]
    assert [named_port(container, p["targetPort"]) for p in http] == [http_port]
    assert all(p["name"] != "http" for p in epp["spec"]["ports"])  # scraped once, on trio-router
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(http_port)
    ingress = picker["NetworkPolicy", "trio-router"]["spec"]["ingress"]
    assert {p["port"] for rule in ingress for p in rule["ports"]} == {http_port, grpc_port}


def test_the_pool_holds_the_engines_discovery_finds(
    objs: dict[str, dict[str, Any]], picker: dict[tuple[str, str], dict[str, Any]]
) -> None:
    """The InferencePool the routers read names the engines the base's label_selector and port
    do (so the two ways of discovery agree), which the NetworkPolicy lets the routers reach,
    and which the disaggregated example's engines are; never the routers themselves."""
    pool = the_pool(picker)
    raw = tomllib.loads(picker_toml_text())["discovery"]["kubernetes"]
    assert raw["inference_pool"] == pool["metadata"]["name"]
    labels = pool["spec"]["selector"]["matchLabels"]
    assert set(pool["spec"]["selector"]) == {"matchLabels"}  # v1 has no matchExpressions
    terms = dict(t.split("=", 1) for t in raw["label_selector"].split(","))
    assert terms == labels
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert numbers == [raw["port"]]
    assert len(set(numbers)) == len(numbers)  # CEL: port numbers unique

    egress = picker["NetworkPolicy", "trio-router"]["spec"]["egress"]
    (engines,) = [r for r in egress if {"podSelector": {"matchLabels": labels}} in r.get("to", [])]
    assert set(numbers) <= {p["port"] for p in engines["ports"]}

    pods = picker["Deployment", "trio-router"]["spec"]["template"]["metadata"]["labels"]
    assert not labels.items() <= pods.items()
    for doc in yaml_docs(MANIFEST_DIR / "examples" / "vllm-disaggregated.yaml"):
        assert labels.items() <= doc["spec"]["template"]["metadata"]["labels"].items()
    assert pool["metadata"]["labels"].items() <= pods.items()
    assert cluster_config(objs).discovery.kubernetes.port in numbers


def test_picker_role_adds_only_reads_of_inference_pools(
    picker: dict[tuple[str, str], dict[str, Any]],
) -> None:
    role = picker["Role", "trio-router-pod-reader"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {
            "apiGroups": ["inference.networking.k8s.io"],
            "resources": ["inferencepools"],
            "verbs": ["get", "list", "watch"],
        },
    ]
    assert not {kind for kind, _ in picker} & {"ClusterRole", "ClusterRoleBinding"}


def test_the_gateway_example_routes_to_the_pool(
    picker: dict[tuple[str, str], dict[str, Any]],
) -> None:
    """examples/gateway.yaml: a Gateway and an HTTPRoute, valid against the Gateway API's CRDs,
    the route attached to the Gateway and sending everything to the component's pool, with no
    time limit; no namespace (applied in the pool's: the route may only name a pool of its
    own namespace without a ReferenceGrant)."""
    docs = {d["kind"]: d for d in yaml_docs(GATEWAY_EXAMPLE)}
    assert set(docs) == {"Gateway", "HTTPRoute"}
    for doc in docs.values():
        validate_custom(doc)
        assert "namespace" not in doc["metadata"], doc["kind"]
    gateway, route = docs["Gateway"], docs["HTTPRoute"]
    (parent,) = route["spec"]["parentRefs"]
    assert parent.get("kind", "Gateway") == "Gateway"
    assert parent["name"] == gateway["metadata"]["name"]
    assert "namespace" not in parent
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert backend == {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": the_pool(picker)["metadata"]["name"],
    }
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert rule["timeouts"] == {"request": "0s", "backendRequest": "0s"}
    assert [listener["protocol"] for listener in gateway["spec"]["listeners"]] == ["HTTP"]


# --- Containerfile ------------------------------------------------------------------------


def containerfile_uid() -> int:
    users = [rest for kw, rest in stages()[-1] if kw == "USER"]
    assert users, "the final stage sets no USER: it would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit(), f"USER {users[-1]} is not numeric; runAsNonRoot cannot verify a name"
    return int(uid)


def test_containerfile_copies_only_files_that_exist() -> None:
    copies = 0
    for stage in stages():
        for keyword, rest in stage:
            assert keyword != "ADD", "use COPY: ADD fetches URLs and unpacks archives"
            if keyword != "COPY":
                continue
            flags, sources, _ = copy_arguments(rest)
            if any(f.startswith("--from=") for f in flags):
                continue
            for source in sources:
                assert list(REPO.glob(source.rstrip("/"))), f"COPY {source}: not in the repo"
                copies += 1
    assert copies >= 2  # pyproject.toml and src/ at least


def test_containerfile_runs_the_declared_console_script() -> None:
    scripts = pyproject()["project"]["scripts"]
    entrypoint = exec_form(stages()[-1], "ENTRYPOINT")
    assert len(entrypoint) == 1 and entrypoint[0] in scripts
    module, _, function = scripts[entrypoint[0]].partition(":")
    where = REPO / "src" / Path(*module.split("."))
    path = where / "__init__.py" if where.is_dir() else where.with_suffix(".py")
    assert path.is_file(), f"console script {entrypoint[0]} points at missing module {module}"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    assert function in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_containerfile_final_stage_is_the_venv_only() -> None:
    assert len(stages()) >= 2, "multi-stage build"
    builder, *_, final = stages()
    assert builder[0][1].split() == ["python:3.11-slim", "AS", "builder"]
    assert final[0][1].split()[0] == "python:3.11-slim"

    copies = [copy_arguments(rest) for kw, rest in final if kw == "COPY"]
    assert copies == [(["--from=builder"], ["/opt/venv"], "/opt/venv")]
    for keyword, rest in final:
        if keyword == "RUN":
            assert not re.search(r"\b(pip|apt-get|apt|gcc|make)\b", rest), rest
    env = " ".join(rest for kw, rest in final if kw == "ENV")
    assert "PATH=/opt/venv/bin:" in env
    assert containerfile_uid() != 0
    assert [rest for kw, rest in final if kw == "STOPSIGNAL"] == ["SIGTERM"]


LOCK = REPO / "requirements.lock"


def lock_pins() -> dict[str, tuple[Version, list[str], set[str]]]:
    """requirements.lock: each package's pinned version, hashes and what needs it."""
    pins: dict[str, tuple[Version, list[str], set[str]]] = {}
    current = ""
    via_block = False
    for line in LOCK.read_text(encoding="utf-8").splitlines():
        if match := re.match(r"^([A-Za-z0-9_.-]+)==([^ ;\\]+)", line):
            current = canonicalize_name(match[1])
            pins[current] = (Version(match[2]), [], set())
            via_block = False
        elif match := re.match(r"^\s+--hash=(sha256:[0-9a-f]{64})", line):
            pins[current][1].append(match[1])
        elif match := re.match(r"^\s+# via ?(.*)$", line):
            via_block = not match[1]
            if match[1]:
                pins[current][2].add(match[1])
        elif via_block and (match := re.match(r"^\s+#\s+(.+)$", line)):
            pins[current][2].add(match[1])
    return pins


def test_lock_file_pins_exactly_the_declared_dependencies() -> None:
    """Every dependency of pyproject.toml is pinned, with hashes, at a version its specifier
    allows; every package the lock says pyproject.toml needs is still declared."""
    pins = lock_pins()
    declared = {
        canonicalize_name(Requirement(d).name): Requirement(d)
        for d in pyproject()["project"]["dependencies"]
    }
    for name, requirement in declared.items():
        assert name in pins, f"{name} is a dependency but not in requirements.lock"
        version, _, _ = pins[name]
        assert requirement.specifier.contains(version, prereleases=True), (
            f"requirements.lock pins {name}=={version}, outside {requirement.specifier}"
        )
    direct = {
        name for name, (_, _, via) in pins.items() if any(v.startswith("trio-router") for v in via)
    }
    assert direct == set(declared), f"lock and pyproject differ: {direct ^ set(declared)}"
    unhashed = [name for name, (_, hashes, _) in pins.items() if not hashes]
    assert not unhashed, f"pinned without hashes: {unhashed}"


def test_image_installs_from_the_lock_with_hashes_and_is_labelled() -> None:
    builder, *_, final = stages()
    runs = " ".join(rest for kw, rest in builder if kw == "RUN")
    assert "--require-hashes --no-deps -r requirements.lock" in runs
    assert re.search(r"pip install --no-deps /tmp/wheels/", runs)  # nothing resolved again
    assert "pip check" in runs
    args = dict(rest.split("=", 1) for kw, rest in final if kw == "ARG" and "=" in rest)
    assert args["VERSION"] == __version__, "ARG VERSION's default is not the package version"
    labels = " ".join(rest for kw, rest in final if kw == "LABEL")
    for key in ("title", "version", "revision", "licenses", "source"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    assert (
        'org.opencontainers.image.licenses="{}"'.format(pyproject()["project"]["license"]) in labels
    )


def test_builder_leaves_no_build_tools_in_the_venv() -> None:
    runs = " ".join(rest for kw, rest in stages()[0] if kw == "RUN")
    assert "pip uninstall --yes pip setuptools" in runs
    env = " ".join(rest for kw, rest in stages()[0] if kw == "ENV")
    assert "PIP_NO_CACHE_DIR=1" in env


# --- docs ---------------------------------------------------------------------------------


def toml_literal(value: Any) -> str:
    """A default as written in TOML: strings quoted, lists bracketed, numbers as Python shows."""
    if isinstance(value, list):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def test_operations_doc_gives_every_config_key_with_its_default() -> None:
    text = OPERATIONS_DOC.read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `([a-z0-9_.]+)` \| `([^`]*)` \|", text, flags=re.MULTILINE))
    assert set(rows) == set(DEFAULTS), (
        f"missing {sorted(set(DEFAULTS) - set(rows))}, unknown {sorted(set(rows) - set(DEFAULTS))}"
    )
    wrong = {k: rows[k] for k in DEFAULTS if rows[k] != toml_literal(DEFAULTS[k])}
    assert not wrong, f"README.md gives wrong defaults: {wrong}"
