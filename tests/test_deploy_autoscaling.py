"""The engine autoscaling examples (config/kubernetes/examples/autoscaling/) are valid and agree
with each other and with the router.

Two ways to size one model's vLLM engine Deployment on the routers' per-model saturation gauge:
keda/ (a KEDA ScaledObject with the Prometheus scaler) and hpa/ (an autoscaling/v2 HPA on an
External metric, with prometheus-adapter's rule beside it). Both render with kustomize, in the
base's namespace, with the engine Deployment of engine/; the HPA is valid against the Kubernetes
schema, the ScaledObject against KEDA's CRD (tests/fixtures/crds/keda/), unknown fields
rejected. Both scale that Deployment on `max(trio_router_model_saturation{model=...})` of its
served model, Value target 0.8, with the same bounds and pace. keda-from-zero/ is keda/ down to
no engine: a ScaledObject that wakes the model on the requests waiting for it
(`trio_router_model_queued_requests`) and sizes it from one up as keda/ does, with the keys of
the routers' router.toml that make them hold those requests (router-fragment.toml). Static
checks only: no cluster.
"""

from __future__ import annotations

import hashlib
import math
import re
import shutil
import subprocess
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import jsonschema  # type: ignore[import-untyped]  # kubernetes-validate's dependency
import kubernetes_validate
import pytest
import yaml

from test_deploy import (
    DEFAULTS,
    MANIFEST_DIR,
    REPO,
    closed,
    cluster_config,
    flatten,
    kustomization,
    manifests,
    selector_matches,
    yaml_docs,
)
from trio_router.config import Config, config_as_dict, parse_config

EXAMPLE_DIR: Final = MANIFEST_DIR / "examples" / "autoscaling"
ENGINE_DIR: Final = EXAMPLE_DIR / "engine"
ADAPTER_VALUES: Final = EXAMPLE_DIR / "hpa" / "prometheus-adapter-values.yaml"
DISAGGREGATED: Final = MANIFEST_DIR / "examples" / "vllm-disaggregated.yaml"
KEDA_CRD_DIR: Final = REPO / "tests" / "fixtures" / "crds" / "keda"
KEDA_CRD: Final = KEDA_CRD_DIR / "keda.sh_scaledobjects.yaml"
FROM_ZERO_DIR: Final = EXAMPLE_DIR / "keda-from-zero"
ROUTER_FRAGMENT: Final = FROM_ZERO_DIR / "router-fragment.toml"

METRIC: Final = "trio_router_model_saturation"  # the metric the examples size engines on
QUEUED: Final = "trio_router_model_queued_requests"  # the one keda-from-zero wakes a model on
BUILD_INFO: Final = "trio_router_build_info"  # always 1: "a router reports", for a 0 fallback
TARGET: Final = 0.8
# What kind each example adds to the engine Deployment.
SCALERS: Final = {
    "keda": "ScaledObject",
    "hpa": "HorizontalPodAutoscaler",
    "keda-from-zero": "ScaledObject",
}
# A Kubernetes label value (what an HPA's metric selector may hold), as the API machinery checks.
LABEL_VALUE: Final = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
QUERY: Final = re.compile(r'max\((?P<metric>[a-z_:]+)\{model="(?P<model>[^"]+)"\}\)')


# --- helpers ------------------------------------------------------------------------------


def render_by_hand(directory: Path) -> list[dict[str, Any]]:
    """What kustomize makes of the examples' kustomizations: resources (files, or directories
    with a kustomization of their own) in order, the namespace on every object."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text(encoding="utf-8"))
    assert set(kust) <= {"apiVersion", "kind", "namespace", "resources"}, sorted(kust)
    docs: list[dict[str, Any]] = []
    for name in kust["resources"]:
        path = (directory / name).resolve()
        docs.extend(render_by_hand(path) if path.is_dir() else yaml_docs(path))
    if "namespace" in kust:
        for doc in docs:
            doc["metadata"]["namespace"] = kust["namespace"]
    return docs


def render(directory: Path) -> dict[str, dict[str, Any]]:
    """The objects `kubectl apply -k directory` would create, by kind: `kubectl kustomize`
    when kubectl is installed, else render_by_hand()."""
    if kubectl := shutil.which("kubectl"):
        out = subprocess.run(
            [kubectl, "kustomize", str(directory)],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        docs = [d for d in yaml.safe_load_all(out) if d]
    else:
        docs = render_by_hand(directory)
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "two objects of one kind"
    return by_kind


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[str, dict[str, Any]]]:
    """Each example's rendered objects by kind, by example (keda, hpa, keda-from-zero)."""
    return {name: render(EXAMPLE_DIR / name) for name in SCALERS}


@pytest.fixture(scope="module")
def config() -> Config:
    """The Config the routers of the base run."""
    return cluster_config(manifests())


def engine() -> dict[str, Any]:
    (deployment,) = yaml_docs(ENGINE_DIR / "vllm.yaml")
    return deployment


def engine_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert isinstance(container, dict)
    return container


def served_model(deployment: dict[str, Any]) -> str:
    """The model name vLLM serves (its --served-model-name, else its --model): what clients
    send, and the router's `model` label."""
    args: dict[str, str] = dict(
        a.split("=", 1) for a in engine_container(deployment)["args"] if "=" in a
    )
    return args.get("--served-model-name", args["--model"])


def keda_crd_digest() -> str:
    """The SHA-256 the fixture's README gives for the vendored CRD."""
    text = (KEDA_CRD_DIR / "README.md").read_text(encoding="utf-8")
    digests: list[str] = re.findall(
        rf"^\| `{re.escape(KEDA_CRD.name)}` \|.*\| ([0-9a-f]{{64}}) \|$", text, re.MULTILINE
    )
    (digest,) = digests
    return digest


def validate_scaled_object(doc: dict[str, Any]) -> None:
    """Validate a ScaledObject as `kubectl apply --validate=strict` would, but for the CRD's
    CEL rule (minReplicaCount <= maxReplicaCount, checked by the tests instead): the served
    version's openAPIV3Schema with unknown fields rejected, its metadata as ObjectMeta."""
    (crd,) = yaml_docs(KEDA_CRD)
    assert crd["spec"]["group"] == "keda.sh" and crd["spec"]["names"]["kind"] == "ScaledObject"
    (version,) = [v for v in crd["spec"]["versions"] if v["served"]]
    assert doc["apiVersion"] == f"keda.sh/{version['name']}" and doc["kind"] == "ScaledObject"
    validator = jsonschema.Draft4Validator(closed(version["schema"]["openAPIV3Schema"]))
    errors = [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(doc)
    ]
    assert not errors, f"ScaledObject {doc['metadata'].get('name')}: {errors}"
    meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}
    kubernetes_validate.validate(meta, kubernetes_validate.latest_version(), strict=True)


def keda_trigger(scaled_object: dict[str, Any]) -> dict[str, Any]:
    (trigger,) = scaled_object["spec"]["triggers"]
    assert isinstance(trigger, dict)
    return trigger


def merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """TOML table `base` with the keys of `patch` set in it, at any depth."""
    out = dict(base)
    for key, value in patch.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def duration_s(text: str) -> float:
    """A Prometheus duration of one unit ("30s", "1m", "2h") in seconds."""
    match = re.fullmatch(r"(\d+)([smh])", text)
    assert match, text
    return int(match[1]) * {"s": 1, "m": 60, "h": 3600}[match[2]]


def hpa_metric(hpa: dict[str, Any]) -> dict[str, Any]:
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    external: dict[str, Any] = metric["external"]
    return external


def adapter_rule() -> dict[str, Any]:
    values = yaml.safe_load(ADAPTER_VALUES.read_text(encoding="utf-8"))
    assert set(values) == {"rules"} and set(values["rules"]) == {"external"}
    (rule,) = values["rules"]["external"]
    assert isinstance(rule, dict)
    return rule


def adapter_query(rule: dict[str, Any], selector: dict[str, str], namespace: str) -> str:
    """The PromQL prometheus-adapter runs for an HPA's external metric: the rule's metricsQuery
    with <<.Series>> the series name and <<.LabelMatchers>> the selector's matchers followed by
    the HPA's namespace (a namespaced rule), as BuildExternal makes them."""
    (series,) = re.findall(r"^([a-z_:]+)\{", rule["seriesQuery"])
    matchers = [f'{key}="{value}"' for key, value in selector.items()]
    overrides = rule["resources"]["overrides"].items()
    (label,) = [k for k, v in overrides if v == {"resource": "namespace"}]
    matchers.append(f'{label}="{namespace}"')
    query: str = (
        rule["metricsQuery"]
        .replace("<<.Series>>", series)
        .replace("<<.LabelMatchers>>", ",".join(matchers))
    )
    assert "<<" not in query, f"a template argument left: {query}"
    return query


# --- the examples -------------------------------------------------------------------------


@pytest.mark.parametrize("example", list(SCALERS))
def test_each_example_renders_the_engines_and_their_scaler_in_the_routers_namespace(
    example: str, rendered: dict[str, dict[str, dict[str, Any]]]
) -> None:
    """`kubectl apply -k examples/autoscaling/<example>` creates the engine Deployment and one
    scaler naming it, both where the routers are (their discovery watches their own namespace),
    and the manifests kustomize reads are the ones on disk (the renderer by hand agrees)."""
    objects = rendered[example]
    assert set(objects) == {"Deployment", SCALERS[example]}
    namespace = kustomization()["namespace"]
    for kind, doc in objects.items():
        assert doc["metadata"]["namespace"] == namespace, kind
    deployment, scaler = objects["Deployment"], objects[SCALERS[example]]
    assert scaler["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    by_hand = {d["kind"]: d for d in render_by_hand(EXAMPLE_DIR / example)}
    assert by_hand == objects


def test_the_engines_are_found_by_the_routers_and_left_to_the_autoscaler(config: Config) -> None:
    """engine/vllm.yaml: strictly valid; its pods match the routers' label selector, serve on
    discovery.kubernetes.port and are probed for readiness (the HPA sizes on ready pods); no
    `replicas` for an apply to reset; a selector no pod of the disaggregated example matches,
    nor its pods this one's (one model's engines, one Deployment)."""
    deployment = engine()
    kubernetes_validate.validate(deployment, kubernetes_validate.latest_version(), strict=True)
    assert "replicas" not in deployment["spec"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    assert selector_matches(config.discovery.kubernetes.label_selector, labels)
    container = engine_container(deployment)
    ports = {p["containerPort"] for p in container["ports"]}
    assert config.discovery.kubernetes.port in ports
    assert f"--port={config.discovery.kubernetes.port}" in container["args"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    for other in yaml_docs(DISAGGREGATED):
        theirs = other["spec"]["template"]["metadata"]["labels"]
        assert not selector.items() <= theirs.items(), other["metadata"]["name"]
        assert not other["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_hpa_is_strictly_valid_and_scales_on_the_saturation_of_the_engines_model(
    rendered: dict[str, dict[str, dict[str, Any]]],
) -> None:
    """An External metric, trio_router_model_saturation, selected by the served model's name,
    which must be a valid label value (the HPA controller turns the selector into a label
    selector and refuses "Qwen/Qwen3-8B"); a Value target of 0.8."""
    objects = rendered["hpa"]
    hpa, deployment = objects["HorizontalPodAutoscaler"], objects["Deployment"]
    kubernetes_validate.validate(hpa, kubernetes_validate.latest_version(), strict=True)
    external = hpa_metric(hpa)
    assert external["metric"]["name"] == METRIC
    assert external["metric"]["selector"] == {"matchLabels": {"model": served_model(deployment)}}
    model = served_model(deployment)
    assert LABEL_VALUE.fullmatch(model) and len(model) <= 63, model
    assert external["target"]["type"] == "Value"
    assert float(external["target"]["value"]) == TARGET
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_the_scaled_object_is_valid_against_kedas_crd_and_queries_the_max(
    rendered: dict[str, dict[str, dict[str, Any]]],
) -> None:
    """The ScaledObject passes KEDA's schema strictly; its one trigger is the Prometheus
    scaler with exactly max(trio_router_model_saturation{model="<served model>"}), a Value
    target of 0.8, an in-cluster server and no answer taken as an error (not as 0, which would
    scale the engines down); never to zero replicas (its cooldownPeriod only paces that)."""
    objects = rendered["keda"]
    scaled, deployment = objects["ScaledObject"], objects["Deployment"]
    validate_scaled_object(scaled)
    spec = scaled["spec"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]  # the CRD's CEL rule, and more
    assert "idleReplicaCount" not in spec
    trigger = keda_trigger(scaled)
    assert trigger["type"] == "prometheus"
    assert trigger["metricType"] == "Value"
    metadata = trigger["metadata"]
    match = QUERY.fullmatch(metadata["query"])
    assert match, metadata["query"]
    assert match["metric"] == METRIC
    assert match["model"] == served_model(deployment)
    assert float(metadata["threshold"]) == TARGET
    assert metadata["ignoreNullValues"] == "false"
    in_cluster = r"https?://[a-z0-9.-]+\.svc(\.cluster\.local)?(:\d+)?"
    assert re.fullmatch(in_cluster, metadata["serverAddress"]), metadata["serverAddress"]


def test_both_examples_scale_the_same_engines_the_same_way(
    rendered: dict[str, dict[str, dict[str, Any]]],
) -> None:
    """KEDA and the plain HPA are two routes to one result: the same Deployment, model,
    target, bounds and pace up and down (KEDA hands its behavior to the HPA it creates)."""
    keda, hpa = rendered["keda"]["ScaledObject"]["spec"], rendered["hpa"]
    assert rendered["keda"]["Deployment"] == hpa["Deployment"]
    hpa_spec = hpa["HorizontalPodAutoscaler"]["spec"]
    assert keda["scaleTargetRef"] == hpa_spec["scaleTargetRef"]
    assert (keda["minReplicaCount"], keda["maxReplicaCount"]) == (
        hpa_spec["minReplicas"],
        hpa_spec["maxReplicas"],
    )
    assert keda["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa_spec["behavior"]
    scale_down = hpa_spec["behavior"]["scaleDown"]
    assert scale_down["stabilizationWindowSeconds"] >= 300  # engines take minutes to start


def test_the_adapter_rule_serves_the_hpas_metric_with_the_scaled_objects_query(
    rendered: dict[str, dict[str, dict[str, Any]]],
) -> None:
    """prometheus-adapter-values.yaml: an external rule naming trio_router_model_saturation,
    namespaced by the `namespace` label; for the HPA's selector in the base's namespace it runs
    the ScaledObject's query plus that namespace's matcher, one series (the HPA adds up what an
    external metric returns: a `by` clause would hand it one series per label value)."""
    rule = adapter_rule()
    hpa = rendered["hpa"]["HorizontalPodAutoscaler"]
    external = hpa_metric(hpa)
    name = external["metric"]["name"]
    assert re.fullmatch(rule["name"]["matches"], METRIC)
    assert rule["name"]["as"] == name == METRIC
    assert rule["seriesQuery"].startswith(f"{METRIC}{{")
    assert rule["resources"] == {"overrides": {"namespace": {"resource": "namespace"}}}
    namespace = hpa["metadata"]["namespace"]
    query = adapter_query(rule, external["metric"]["selector"]["matchLabels"], namespace)
    keda_query = keda_trigger(rendered["keda"]["ScaledObject"])["metadata"]["query"]
    assert query == keda_query.replace('"}', f'",namespace="{namespace}"}}')
    assert " by " not in query and " by(" not in query


def test_the_from_zero_scaled_object_wakes_the_model_on_the_requests_waiting_for_it(
    rendered: dict[str, dict[str, dict[str, Any]]],
) -> None:
    """keda-from-zero's ScaledObject passes KEDA's schema strictly and scales keda/'s engines
    from 0 (KEDA's own step) to keda/'s maximum, with keda/'s pace. Two Prometheus triggers,
    each active above 0 and an error on no answer: `queued`, the served model's waiting
    requests summed over the routers (each one's most in the last minute); `saturation`,
    keda/'s trigger. Each query reads 0 rather than nothing while some router reports
    (build_info), so a sleeping model is not an error on every poll."""
    objects, keda = rendered["keda-from-zero"], rendered["keda"]["ScaledObject"]
    scaled, deployment = objects["ScaledObject"], objects["Deployment"]
    validate_scaled_object(scaled)
    spec = scaled["spec"]
    assert spec["minReplicaCount"] == 0 < spec["maxReplicaCount"] == keda["spec"]["maxReplicaCount"]
    assert "idleReplicaCount" not in spec
    assert spec["cooldownPeriod"] >= 600  # idle for a good while, not between two requests
    assert spec["pollingInterval"] <= keda["spec"]["pollingInterval"]
    assert spec["advanced"] == keda["spec"]["advanced"]
    triggers = {t["name"]: t for t in spec["triggers"]}
    assert list(triggers) == ["queued", "saturation"]
    saturation, theirs = triggers["saturation"], keda_trigger(keda)
    fallback = f" or 0 * max({BUILD_INFO})"
    model = served_model(deployment)
    queued_query = f'sum(max_over_time({QUEUED}{{model="{model}"}}[1m])){fallback}'
    assert triggers["queued"]["metadata"]["query"] == queued_query
    assert saturation["metadata"]["query"] == theirs["metadata"]["query"] + fallback
    assert saturation["metadata"]["threshold"] == theirs["metadata"]["threshold"]
    for trigger in triggers.values():
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
        metadata = trigger["metadata"]
        assert metadata["activationThreshold"] == "0"
        assert metadata["ignoreNullValues"] == "false"
        assert metadata["serverAddress"] == theirs["metadata"]["serverAddress"]


def test_the_queued_trigger_never_asks_the_hpa_for_more_than_one_engine(config: Config) -> None:
    """The HPA asks ceil(ready engines x value / threshold) for a Value metric: with every
    engine ready and every router replica's queue full (admission.queue_size), the queued
    trigger's count is still one, so the saturation trigger alone sizes the engines from one
    up (a backlog gathered while the first engine loads would otherwise ask for many)."""
    (scaled,) = yaml_docs(FROM_ZERO_DIR / "scaledobject.yaml")
    queued = {t["name"]: t for t in scaled["spec"]["triggers"]}["queued"]
    routers = manifests()["HorizontalPodAutoscaler"]["spec"]["maxReplicas"]
    most_waiting = routers * config.admission.queue_size
    engines = scaled["spec"]["maxReplicaCount"]
    assert math.ceil(engines * most_waiting / float(queued["metadata"]["threshold"])) == 1


def test_the_router_fragment_makes_the_routers_hold_the_models_requests(config: Config) -> None:
    """router-fragment.toml sets keys the router has (it loads as a Config of its own: see
    test_deploy); set in the base's router.toml it lists the engines' served model in
    routing.models with the waiting room on, and changes nothing the fragment does not name."""
    fragment = tomllib.loads(ROUTER_FRAGMENT.read_text(encoding="utf-8"))
    keys = flatten(fragment)
    assert set(keys) <= set(DEFAULTS)
    base = tomllib.loads(manifests()["ConfigMap"]["data"]["router.toml"])
    result = parse_config(merged(base, fragment), source=str(ROUTER_FRAGMENT))
    assert served_model(engine()) in result.routing.models
    assert result.admission.wait_for_engine
    before, after = flatten(config_as_dict(config)), flatten(config_as_dict(result))
    assert {k for k in DEFAULTS if before[k] != after[k]} <= set(keys)


def test_a_request_waiting_for_a_sleeping_model_is_seen_before_its_wait_ends() -> None:
    """A request that waits the fragment's queue_timeout_s is in at least one scrape of the
    routers (config/monitoring's ServiceMonitor), and that sample is still inside the queued
    query's max_over_time range when KEDA next polls, whenever that is."""
    fragment = tomllib.loads(ROUTER_FRAGMENT.read_text(encoding="utf-8"))
    (monitor,) = yaml_docs(REPO / "config" / "monitoring" / "servicemonitor.yaml")
    (endpoint,) = monitor["spec"]["endpoints"]
    scrape_s = duration_s(endpoint["interval"])
    (scaled,) = yaml_docs(FROM_ZERO_DIR / "scaledobject.yaml")
    queued = {t["name"]: t for t in scaled["spec"]["triggers"]}["queued"]
    (window,) = re.findall(r"\[(\w+)\]", queued["metadata"]["query"])
    assert fragment["admission"]["queue_timeout_s"] >= scrape_s
    assert duration_s(window) >= scrape_s + scaled["spec"]["pollingInterval"]


def test_every_metric_the_examples_name_is_one_the_routers_export() -> None:
    """keda/, hpa/ and engine/ name no trio_router_* series but the saturation gauge;
    keda-from-zero/ adds the queued-requests gauge and build_info (its fallback to 0). Each is in
    the README's metrics reference: nothing invented."""
    names: dict[str, set[str]] = {}
    for path in sorted(EXAMPLE_DIR.rglob("*.yaml")) + sorted(EXAMPLE_DIR.rglob("*.toml")):
        found = set(re.findall(r"\btrio_router_[a-z_]+", path.read_text(encoding="utf-8")))
        names.setdefault(path.relative_to(EXAMPLE_DIR).parts[0], set()).update(found)
    assert names.pop("keda-from-zero") == {METRIC, QUEUED, BUILD_INFO}
    assert set(names) == {"keda", "hpa", "engine"}
    assert set().union(*names.values()) == {METRIC}
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for name in (METRIC, QUEUED, BUILD_INFO):
        assert re.search(rf"^\| `{name}` \| gauge \|", readme, re.MULTILINE), name


# --- the vendored CRD ---------------------------------------------------------------------


def test_the_vendored_keda_crd_is_the_upstream_file() -> None:
    """tests/fixtures/crds/keda/ holds KEDA's ScaledObject CRD, byte for byte the release its
    README names."""
    assert {p.name for p in KEDA_CRD_DIR.glob("*.yaml")} == {KEDA_CRD.name}
    assert hashlib.sha256(KEDA_CRD.read_bytes()).hexdigest() == keda_crd_digest()


def test_the_strict_scaled_object_validation_rejects_what_the_api_server_would(
    rendered: dict[str, dict[str, dict[str, Any]]],
) -> None:
    """The validation above is not vacuous: an unknown field, a missing required one and a
    value out of range are each caught, at any depth."""
    good = rendered["keda"]["ScaledObject"]
    validate_scaled_object(good)
    mutations: list[Callable[[dict[str, Any]], object]] = [
        lambda d: d["spec"].update(minReplicas=1),  # the HPA's spelling, unknown to KEDA
        lambda d: d["spec"]["triggers"][0].update(metricTyp="Value"),
        lambda d: d["spec"]["scaleTargetRef"].pop("name"),
        lambda d: d["spec"]["triggers"][0].pop("metadata"),
        lambda d: d["spec"].update(pollingInterval=0),
        lambda d: d["spec"]["triggers"][0]["metadata"].update(threshold=0.8),  # not a string
    ]
    for mutate in mutations:
        bad = yaml.safe_load(yaml.safe_dump(good))
        mutate(bad)
        with pytest.raises(AssertionError):
            validate_scaled_object(bad)
