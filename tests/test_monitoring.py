"""The monitoring objects in config/monitoring/ agree with the router and with each other.

Every metric the Grafana dashboard and the PrometheusRule query is one a real router exposes
(a Kubernetes-mode router, fed by the fake API server, after traffic that creates every
labelled series); the rules pass promtool and fire as documented; the ServiceMonitor selects
the Service of config/kubernetes/ and gives its series the job the alerts select; kustomize
renders the three objects in the router's namespace, the dashboard embedded in its ConfigMap.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final

import httpx
import pytest
import trio
import trio.testing
import yaml
from prometheus_client.parser import text_string_to_metric_families

from trio_router import server
from trio_router.config import (
    AdmissionConfig,
    Config,
    DiscoveryConfig,
    KubernetesConfig,
    ProbeConfig,
    ServerConfig,
    StatsConfig,
)
from trio_router.serving.reload import ReloadOutcome
from trio_router.table import RoutingTable
from trio_router.testing import FakeEngine, serve_fake_engine
from trio_router.testing.fake_apiserver import FakeApiServer
from trio_router.testing.harness import CHAT, LIMIT, chat

REPO: Final = Path(__file__).resolve().parents[1]
MONITORING: Final = REPO / "config" / "monitoring"
DASHBOARD: Final = MONITORING / "grafana-dashboard.json"
RULES: Final = MONITORING / "prometheusrule.yaml"
SERVICE_MONITOR: Final = MONITORING / "servicemonitor.yaml"
KUSTOMIZATION: Final = MONITORING / "kustomization.yaml"
SERVICE: Final = REPO / "config" / "kubernetes" / "60-service.yaml"
BASE_KUSTOMIZATION: Final = REPO / "config" / "kubernetes" / "kustomization.yaml"
DATASOURCE: Final = "${datasource}"
SEVERITIES: Final = {"critical", "warning"}
PROMETHEUS_SERIES: Final = {"up"}  # made by Prometheus for every target, not by the router
# kubectl apply keeps the whole object in an annotation, and annotations are limited to this.
ANNOTATION_LIMIT: Final = 256 * 1024


def load_yaml(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    return doc


def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return doc


def alerts() -> list[dict[str, Any]]:
    return [rule for group in load_yaml(RULES)["spec"]["groups"] for rule in group["rules"]]


# -- metric names in PromQL -------------------------------------------------------------------
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_VARIABLE = re.compile(r"\$(?:\{[^}]*\}|\w+)")  # Grafana's $name, ${name}, ${name:format}
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_DURATION = re.compile(r"(?<![\w:.])(?:\d+(?:ms|[smhdwy]))+\b")
_NUMBER = re.compile(r"(?<![\w:.])(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_IDENTIFIER = re.compile(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?")
_KEYWORDS: Final = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "inf",
    "nan",
    "start",
    "end",
    "atan2",
}
_LABEL_VALUES = re.compile(r"\s*label_values\((.+),\s*\w+\s*\)\s*")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left of its identifiers once
    strings, Grafana variables, label matchers, ranges, grouping clauses, durations, numbers,
    function names and keywords are taken out."""
    text = _STRING.sub(" ", expr)
    text = _VARIABLE.sub(" ", text)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _DURATION.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    return {m[1] for m in _IDENTIFIER.finditer(text) if not m[2] and m[1].lower() not in _KEYWORDS}


def test_promql_metric_names() -> None:
    assert promql_metric_names(
        "histogram_quantile(0.99, sum by (le, model) (rate(trio_router_request_duration_"
        'seconds_bucket{job=~"$job", model!="a{b}"}[$__rate_interval])))'
    ) == {"trio_router_request_duration_seconds_bucket"}
    assert promql_metric_names('absent(up{job="trio-router"} == 1)') == {"up"}
    assert promql_metric_names(
        "sum(rate(a_total[5m] offset 1h30m)) by (x) / on (x) group_left b:recorded "
        "> bool 1e3 and c unless -0.5 * process_cpu_seconds_total"
    ) == {"a_total", "b:recorded", "c", "process_cpu_seconds_total"}
    assert promql_metric_names('max(trio_router_typo{engine=~"${engine:regex}"})') == {
        "trio_router_typo"
    }


def dashboard_queries() -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every query of the dashboard: panel targets (rows' nested panels
    too) and the metric selectors of the template variables' label_values()."""
    for panel in all_panels(dashboard()):
        for target in panel.get("targets", []):
            yield f"panel {panel['id']} {panel['title']!r} {target['refId']}", target["expr"]
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        query = query["query"] if isinstance(query, dict) else query
        selector = _LABEL_VALUES.fullmatch(query)
        assert selector, f"variable {variable['name']}: {query!r} is not label_values(..., ..)"
        yield f"variable {variable['name']}", selector[1]


def rule_queries() -> Iterator[tuple[str, str]]:
    for rule in alerts():
        yield rule["alert"], rule["expr"]


def all_panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])


# -- a live router with every series ----------------------------------------------------------
def sample_names(text: str) -> set[str]:
    """The names of the samples of an exposition: what PromQL can select (a counter's family
    name without `_total`, or a histogram's without `_bucket`, selects nothing)."""
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


@dataclass
class LiveRouter:
    client: httpx.AsyncClient
    engine_scopes: list[trio.CancelScope]  # cancel one to stop that engine
    reloads: list[ReloadOutcome] = field(default_factory=list)
    _reloaded: trio.Event = field(default_factory=trio.Event)

    def record_reload(self, outcome: ReloadOutcome) -> None:
        self.reloads.append(outcome)
        self._reloaded.set()

    async def sighup(self) -> ReloadOutcome:
        """Send this process SIGHUP; the router's reload outcome."""
        self._reloaded = trio.Event()
        os.kill(os.getpid(), signal.SIGHUP)
        await self._reloaded.wait()
        return self.reloads[-1]


def scraped(engine: FakeEngine, times: int) -> bool:
    return len(engine.requests_to("/metrics")) >= times


def busy(engine: FakeEngine) -> bool:
    return engine.in_flight == 1


@asynccontextmanager
async def kubernetes_router(
    apiserver: FakeApiServer, kubeconfig: Path, engines: list[FakeEngine]
) -> AsyncIterator[LiveRouter]:
    """The router with Kubernetes discovery of `engines` (pods pod-0, pod-1, ... on 127.0.1.1,
    127.0.1.2, ..., one port), engine stats scraped every 100 ms, admission capped at one
    request per engine with a queue of one, and SIGHUP reloading the same config; yields
    once every engine is routable and has been scraped once."""
    scopes = [trio.CancelScope() for _ in engines]

    async def serve(i: int, port: int, *, task_status: trio.TaskStatus[str]) -> None:
        with scopes[i]:
            await serve_fake_engine(engines[i], f"127.0.1.{i + 1}", port, task_status=task_status)

    async with trio.open_nursery() as nursery:
        port = 0
        for i in range(len(engines)):
            url = await nursery.start(serve, i, port)
            port = int(url.rsplit(":", 1)[1])
            apiserver.add_pod(f"pod-{i}", ip=f"127.0.1.{i + 1}")
        config = Config(
            server=ServerConfig(bind="127.0.0.1:0", drain_s=1.0),
            discovery=DiscoveryConfig(
                mode="kubernetes",
                kubernetes=KubernetesConfig(
                    namespace=apiserver.namespace, port=port, kubeconfig=str(kubeconfig)
                ),
            ),
            probe=ProbeConfig(interval_s=60.0, timeout_s=2.0, backoff_max_s=60.0),
            stats=StatsConfig(interval_s=0.1, timeout_s=1.0),
            admission=AdmissionConfig(
                max_in_flight_per_engine=1, queue_size=1, queue_timeout_s=LIMIT
            ),
        )
        table = RoutingTable()
        async with httpx.AsyncClient(timeout=LIMIT) as client:
            router = LiveRouter(client, scopes)
            (url,) = await nursery.start(
                partial(
                    server.run,
                    config,
                    load=lambda: config,
                    table=table,
                    on_reload=router.record_reload,
                )
            )
            client.base_url = httpx.URL(url)
            while len(table.routable("fake-model")) < len(engines):
                await table.wait_changed()
            for engine in engines:  # scraped once as it became routable (idle since)
                await engine.wait_until(partial(scraped, engine, 1))
            yield router
        nursery.cancel_scope.cancel()


async def exposed_sample_names(apiserver: FakeApiServer, kubeconfig: Path) -> set[str]:
    """Every sample name a router exposes once it has answered, streamed, queued, rejected,
    failed over and reloaded: the union of a scrape taken while a request is queued and one
    at the end."""
    engines = [FakeEngine(name="a", tokens=3), FakeEngine(name="b", tokens=3)]
    names: set[str] = set()
    with trio.fail_after(LIMIT):
        async with kubernetes_router(apiserver, kubeconfig, engines) as router:
            client = router.client
            for _ in range(2):
                assert (await client.post(CHAT, json=chat())).status_code == 200
            streamed = await client.post(
                CHAT, json=chat(stream=True, stream_options={"include_usage": True})
            )
            assert streamed.status_code == 200

            # Both engines busy (one request each, held), a third request queued, a fourth
            # turned away: the queue is full.
            for engine in engines:
                engine.gate = trio.Event()
            statuses: list[int] = []

            async def post() -> None:
                statuses.append((await client.post(CHAT, json=chat())).status_code)

            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(post)
                for engine in engines:
                    await engine.wait_until(partial(busy, engine))
                # In use, they are scraped: two more scrapes began, so one's figures are stored.
                counts = [len(engine.requests_to("/metrics")) for engine in engines]
                for engine, count in zip(engines, counts, strict=True):
                    await engine.wait_until(partial(scraped, engine, count + 2))
                await trio.testing.wait_all_tasks_blocked()  # the third request is queued
                text = (await client.get("/metrics")).text
                assert 'trio_router_queued_requests{model="fake-model"} 1.0' in text
                names |= sample_names(text)
                rejected = await client.post(CHAT, json=chat())
                assert rejected.status_code == 429, rejected.text
                for engine in engines:
                    assert engine.gate is not None
                    engine.gate.set()
            assert statuses == [200, 200, 200]

            # An engine that stopped answering: the request goes to the other one.
            router.engine_scopes[1].cancel()
            failed_over = [(await client.post(CHAT, json=chat())).status_code for _ in range(2)]
            assert failed_over == [200, 200]
            assert not (await router.sighup()).error
            names |= sample_names((await client.get("/metrics")).text)
    return names


async def test_every_queried_metric_is_exposed(apiserver: FakeApiServer, kubeconfig: Path) -> None:
    exposed = await exposed_sample_names(apiserver, kubeconfig)
    # The traffic above made the series that exist only after it.
    assert {
        "trio_router_queue_wait_seconds_bucket",
        "trio_router_rejected_requests_total",
        "trio_router_engine_unreachable_total",
        "trio_router_engine_kv_cache_usage_ratio",
        "trio_router_discovery_healthy",
        "trio_router_tokens_total",
        "trio_router_config_reloads_total",
    } <= exposed
    for source, queries in (("dashboard", dashboard_queries()), ("rules", rule_queries())):
        used: set[str] = set()
        for where, expr in queries:
            names = promql_metric_names(expr)
            assert names, f"{source}, {where}: no metric in {expr!r}"
            missing = names - exposed - PROMETHEUS_SERIES
            assert not missing, f"{source}, {where}: {sorted(missing)} not exposed: {expr!r}"
            used |= names
        assert any(n.startswith("trio_router_discovery_") for n in used), source


# -- the PrometheusRule ---------------------------------------------------------------------
def test_rules_are_alerts_with_severity_summary_and_description() -> None:
    doc = load_yaml(RULES)
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert "namespace" not in doc["metadata"]  # set once, by the kustomization
    rules = alerts()
    names = [rule["alert"] for rule in rules]
    assert len(set(names)) == len(names), names
    job = service_monitor_job()
    for rule in rules:
        name = rule["alert"]
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, name
        assert rule["labels"]["severity"] in SEVERITIES, name
        annotations = rule["annotations"]
        assert annotations["summary"].strip() and annotations["description"].strip(), name
        if "for" in rule:
            assert re.fullmatch(r"(\d+[smh])+", rule["for"]), (name, rule["for"])
        # Every selector names the job the ServiceMonitor gives the router's series.
        metrics = promql_metric_names(rule["expr"])
        assert metrics, name
        for metric in metrics:
            for selector in re.finditer(
                rf"(?<![\w:]){metric}(?![\w:])\s*(\{{[^}}]*\}})?", rule["expr"]
            ):
                assert f'job="{job}"' in (selector[1] or ""), (name, selector[0])
    assert {rule["labels"]["severity"] for rule in rules} == SEVERITIES


def rule_groups_file(tmp_path: Path, *, annotations: bool = True) -> Path:
    """The PrometheusRule's groups as a Prometheus rule file."""
    groups = load_yaml(RULES)["spec"]["groups"]
    if not annotations:
        for group in groups:
            for rule in group["rules"]:
                del rule["annotations"]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}), encoding="utf-8")
    return path


def promtool() -> str:
    if (path := shutil.which("promtool")) is None:
        pytest.skip("promtool is not installed")
    return path


def test_rules_pass_promtool_check(tmp_path: Path) -> None:
    result = subprocess.run(
        [promtool(), "check", "rules", str(rule_groups_file(tmp_path))],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


# Series over time (promtool's expanding notation) and the alerts expected from them: at each
# minute, the label sets (besides alertname and severity) of the firing alerts.
Series = list[tuple[str, str]]
Expected = list[tuple[int, list[dict[str, str]]]]
ALERT_CASES: Final[dict[str, tuple[Series, Expected]]] = {
    "TrioRouterDown": (
        [("up{job='trio-router', instance='a'}", "0x20")],
        [(6, [{}]), (3, [])],
    ),  # absent() of a comparison has no labels
    "TrioRouterReplicaDown": (
        [
            ("up{job='trio-router', instance='a'}", "1x20"),
            ("up{job='trio-router', instance='b'}", "0x20"),
        ],
        [(6, [{"job": "trio-router", "instance": "b"}])],
    ),
    "TrioRouterNoRoutableEngine": (
        [("trio_router_routable_engines{job='trio-router', instance='a'}", "2 2 0x10")],
        [(3, []), (5, [{"job": "trio-router", "instance": "a"}])],
    ),
    "TrioRouterModelUnavailable": (  # 503s by the router for m; the engines' own 503s for n
        [
            (
                "trio_router_requests_total{job='trio-router', model='m', engine='', status='503'}",
                "0+60x20",
            ),
            (
                "trio_router_requests_total{job='trio-router', model='m', engine='e', "
                "status='200'}",
                "0+10x20",
            ),
            (
                "trio_router_requests_total{job='trio-router', model='n', engine='e', "
                "status='503'}",
                "0+60x20",
            ),
        ],
        [(12, [{"model": "m"}])],
    ),
    "TrioRouterHighErrorRatio": (
        [
            (
                "trio_router_requests_total{job='trio-router', model='m', engine='e', "
                "status='502'}",
                "0+10x30",
            ),
            (
                "trio_router_requests_total{job='trio-router', model='m', engine='e', "
                "status='200'}",
                "0+90x30",
            ),
        ],
        [(16, [{}])],
    ),
    "TrioRouterVeryHighErrorRatio": (  # 10% is not critical
        [
            (
                "trio_router_requests_total{job='trio-router', model='m', engine='e', "
                "status='502'}",
                "0+10x30",
            ),
            (
                "trio_router_requests_total{job='trio-router', model='m', engine='e', "
                "status='200'}",
                "0+90x30",
            ),
        ],
        [(16, [])],
    ),
    "TrioRouterDiscoveryStale": (
        [
            (
                "trio_router_discovery_last_progress_age_seconds{job='trio-router', instance='a'}",
                "800+60x20",
            )
        ],
        [(3, []), (10, [{"job": "trio-router", "instance": "a"}])],
    ),
}


def test_alerts_fire_on_the_series_they_describe(tmp_path: Path) -> None:
    """`promtool test rules`: each case's series fire its alert (with these labels) at the
    given minute, and nothing at the minutes where none is expected."""
    rules = {rule["alert"]: rule for rule in alerts()}
    tests = []
    for name, (series, expected) in ALERT_CASES.items():
        severity = rules[name]["labels"]["severity"]
        tests.append(
            {
                "interval": "1m",
                "input_series": [{"series": s.replace("'", '"'), "values": v} for s, v in series],
                "alert_rule_test": [
                    {
                        "eval_time": f"{minute}m",
                        "alertname": name,
                        "exp_alerts": [
                            {"exp_labels": {**labels, "severity": severity}} for labels in fired
                        ],
                    }
                    for minute, fired in expected
                ],
            }
        )
    # Without annotations: promtool would compare them (their templates pass `check rules`).
    rules_file = rule_groups_file(tmp_path, annotations=False)
    test_file = tmp_path / "rules_test.yaml"
    test_file.write_text(
        yaml.safe_dump(
            {"rule_files": [rules_file.name], "evaluation_interval": "1m", "tests": tests}
        ),
        encoding="utf-8",
    )
    result = subprocess.run(
        [promtool(), "test", "rules", str(test_file)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- the ServiceMonitor and the kustomization -------------------------------------------------
def service_monitor_job() -> str:
    """The job label of the scraped series: the value of the Service's label named by
    jobLabel (the Service's name without one)."""
    monitor, service = load_yaml(SERVICE_MONITOR), load_yaml(SERVICE)
    if label := monitor["spec"].get("jobLabel"):
        job: str = service["metadata"]["labels"][label]
        return job
    name: str = service["metadata"]["name"]
    return name


def test_service_monitor_scrapes_the_router_service() -> None:
    monitor, service = load_yaml(SERVICE_MONITOR), load_yaml(SERVICE)
    assert (monitor["apiVersion"], monitor["kind"]) == (
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
    )
    assert "namespace" not in monitor["metadata"]
    spec = monitor["spec"]
    assert "namespaceSelector" not in spec  # the Service is in the ServiceMonitor's namespace
    assert spec["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = spec["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert service_monitor_job() == "trio-router"


def test_kustomization_sets_the_namespace_once_and_generates_the_dashboard() -> None:
    kust = load_yaml(KUSTOMIZATION)
    assert kust["namespace"] == load_yaml(BASE_KUSTOMIZATION)["namespace"]
    assert sorted(kust["resources"]) == ["prometheusrule.yaml", "servicemonitor.yaml"]
    listed = {*kust["resources"], DASHBOARD.name, KUSTOMIZATION.name}
    assert {p.name for p in MONITORING.iterdir()} == listed  # nothing left out
    (generator,) = kust["configMapGenerator"]
    (source,) = generator["files"]
    assert source.rsplit("=", 1)[-1] == DASHBOARD.name
    assert generator["options"]["labels"]["grafana_dashboard"] == "1"
    assert kust["generatorOptions"]["disableNameSuffixHash"] is True


def rendered() -> list[dict[str, Any]]:
    if (kubectl := shutil.which("kubectl")) is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run(
        [kubectl, "kustomize", str(MONITORING)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def test_kustomize_renders_the_three_objects_in_the_router_namespace() -> None:
    objects = {(o["apiVersion"], o["kind"]): o for o in rendered()}
    assert set(objects) == {
        ("monitoring.coreos.com/v1", "ServiceMonitor"),
        ("monitoring.coreos.com/v1", "PrometheusRule"),
        ("v1", "ConfigMap"),
    }
    namespace = load_yaml(BASE_KUSTOMIZATION)["namespace"]
    assert {o["metadata"]["namespace"] for o in objects.values()} == {namespace}
    config_map = objects["v1", "ConfigMap"]
    assert config_map["metadata"]["name"] == "trio-router-dashboard"  # no hash suffix
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    (key,) = config_map["data"]
    assert key.endswith(".json")
    assert json.loads(config_map["data"][key]) == dashboard()
    assert len(json.dumps(config_map)) < ANNOTATION_LIMIT  # kubectl apply can store it


# -- the dashboard ----------------------------------------------------------------------------
def test_dashboard_panels_variables_and_datasource() -> None:
    board = dashboard()
    assert 36 <= board["schemaVersion"] <= 41 and board["uid"]
    panels = list(all_panels(board))
    ids = [panel["id"] for panel in panels]
    assert len(set(ids)) == len(ids), sorted(ids)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("model", "engine"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"]["uid"] == DATASOURCE
    used = {m for _, expr in dashboard_queries() for m in re.findall(r"\$(\w+)", expr)}
    assert used - {"__rate_interval", "__interval", "__range"} <= set(variables)
    assert {"model", "engine"} <= used

    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        area = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"panel {panel['title']!r} overlaps another"
        cells |= area
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == DATASOURCE, panel["title"]
        targets = panel["targets"]
        assert targets, panel["title"]
        assert len({t["refId"] for t in targets}) == len(targets), panel["title"]
        for target in targets:
            assert target["datasource"]["uid"] == DATASOURCE, panel["title"]
            assert target["expr"].strip(), panel["title"]


def test_dashboard_covers_the_router_metrics() -> None:
    """The dashboard shows every family of the router's own metrics."""
    used = {name for _, expr in dashboard_queries() for name in promql_metric_names(expr)}
    families = {
        "requests_total",
        "request_duration_seconds_bucket",
        "time_to_first_byte_seconds_bucket",
        "in_flight_requests",
        "engines",
        "routable_engines",
        "routable_models",
        "engine_unreachable_total",
        "config_reloads_total",
        "relayed_responses_total",
        "queued_requests",
        "queue_wait_seconds_bucket",
        "rejected_requests_total",
        "saturated_engines",
        "routing_decisions_total",
        "tokens_total",
        "engine_latency_seconds",
        "engine_time_to_first_byte_seconds",
        "engine_running_requests",
        "engine_waiting_requests",
        "engine_kv_cache_usage_ratio",
        "discovery_healthy",
        "discovery_last_progress_age_seconds",
        "discovery_events_total",
        "build_info",
    }
    missing = {f"trio_router_{f}" for f in families} - used
    assert not missing, sorted(missing)
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes"} <= used
