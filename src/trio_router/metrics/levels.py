"""The levels: what is a state rather than an event (engines by state, requests waiting,
saturation, the KV index, discovery health) is read from the live objects when `/metrics` is
scraped, so nothing is updated for them on the request path. Each collector is handed a
callable that reads its source; `registry.Metrics` registers them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, Protocol

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..table import EngineState, RoutingTable


class ModelLoadView(Protocol):
    """One model's load, as admission reports it (`serving.admission.ModelLoad`)."""

    @property
    def queued(self) -> Mapping[str, int]: ...  # requests waiting, by band label
    @property
    def in_flight(self) -> int: ...
    @property
    def engines(self) -> int: ...
    @property
    def saturated(self) -> int: ...
    @property
    def saturation(self) -> float: ...


class TableCollector:
    """Levels read from the routing table at scrape time: nothing to update per request."""

    def __init__(self, table: RoutingTable) -> None:
        self._table = table

    def collect(self) -> Iterable[Metric]:
        states = GaugeMetricFamily(
            "trio_router_engines", "Engines in the routing table by state.", labels=["state"]
        )
        routable = GaugeMetricFamily(
            "trio_router_routable_engines", "Engines that can receive requests now."
        )
        models = GaugeMetricFamily(
            "trio_router_routable_models",
            "Distinct models (base models and adapters) served by routable engines.",
        )
        counts = dict.fromkeys(EngineState, 0)
        for engine in self._table:
            counts[engine.state] += 1
        for state, count in counts.items():
            states.add_metric([state.value], count)
        routable.add_metric([], counts[EngineState.ROUTABLE])
        models.add_metric([], len(self._table.models()))
        return [states, routable, models]


class RelayCollector:
    """How many streamed answers went by the relay (engine chunks passed to the client as
    they came) rather than through the server's own framing."""

    def __init__(self, relayed: Callable[[], int]) -> None:
        self._relayed = relayed

    def collect(self) -> Iterable[Metric]:
        return [
            CounterMetricFamily(
                "trio_router_relayed_responses",
                "Streamed answers whose body the relay moved to "
                "an HTTP/1.1 client as the engine sent it.",
                value=self._relayed(),
            )
        ]


class AdmissionCollector:
    """Requests waiting at the router by model, and saturated engines, read at scrape time."""

    def __init__(self, state: Callable[[], tuple[Mapping[str, int], int]]) -> None:
        self._state = state

    def collect(self) -> Iterable[Metric]:
        queued, saturated = self._state()
        depth = GaugeMetricFamily(
            "trio_router_queued_requests",
            "Requests waiting at the router for a free engine, by model.",
            labels=["model"],
        )
        for model, count in queued.items():
            depth.add_metric([model], count)
        busy = GaugeMetricFamily(
            "trio_router_saturated_engines",
            "Engines that take no more requests now (admission caps, or their own queue).",
        )
        busy.add_metric([], saturated)
        return [depth, busy]


class ModelLoadCollector:
    """The saturation signal per model, read at scrape time (`Admission.load`)."""

    def __init__(self, load: Callable[[], Mapping[str, ModelLoadView]]) -> None:
        self._load = load

    def collect(self) -> Iterable[Metric]:
        saturation = GaugeMetricFamily(
            "trio_router_model_saturation",
            "How full the model's engines are, as this router sees them: 0 idle, 1 every "
            "engine at its limit, above 1 while requests wait at the router (the engines' mean "
            "load, plus the waiting requests over what the engines hold at once). The metric "
            "to scale engines on: max across router replicas.",
            labels=["model"],
        )
        queued = GaugeMetricFamily(
            "trio_router_model_queued_requests",
            "Requests waiting at this router for a free engine, by model and priority band "
            "(a configured priority; sheddable or other for bands clients chose).",
            labels=["model", "priority"],
        )
        in_flight = GaugeMetricFamily(
            "trio_router_model_in_flight_requests",
            "This router's requests in flight to the model's engines.",
            labels=["model"],
        )
        share = GaugeMetricFamily(
            "trio_router_model_saturated_engines_ratio",
            "The share of the model's routable engines that take no more requests now "
            "(admission caps, or their own queue).",
            labels=["model"],
        )
        for model, load in sorted(self._load().items()):
            saturation.add_metric([model], load.saturation)
            for band, count in sorted(load.queued.items()):
                queued.add_metric([model, band], count)
            in_flight.add_metric([model], load.in_flight)
            share.add_metric([model], load.saturated / load.engines if load.engines else 0.0)
        return [saturation, queued, in_flight, share]


class KvCollector:
    """KV-cache events per engine, read at scrape time: {engine: ({counter: value}, blocks
    held in the index)}."""

    _COUNTERS: Final = {
        "batches": "KV-event batches applied",
        "events": "KV events applied",
        "skipped": "KV events or messages that could not be read or applied",
        "gaps": "gaps in an engine's KV-event sequence",
        "replays": "gaps (or late starts) filled by a replay",
        "replay_failures": "replays that failed or could not fill the gap",
        "resets": "times an engine's index entries were dropped (restart, lost events, "
        "AllBlocksCleared)",
    }

    def __init__(self, state: Callable[[], Mapping[str, tuple[Mapping[str, int], int]]]) -> None:
        self._state = state

    def collect(self) -> Iterable[Metric]:
        families = {
            key: CounterMetricFamily(
                f"trio_router_kv_{key}", f"Per engine: {what}.", labels=["engine"]
            )
            for key, what in self._COUNTERS.items()
        }
        blocks = GaugeMetricFamily(
            "trio_router_kv_index_blocks",
            "Prefix blocks each engine holds, as the router's block index knows them.",
            labels=["engine"],
        )
        for engine, (counters, held) in self._state().items():
            for key, family in families.items():
                family.add_metric([engine], float(counters.get(key, 0)))
            blocks.add_metric([engine], float(held))
        return [*families.values(), blocks]


class DiscoveryCollector:
    """Discovery gauges from `DiscoveryStatus.snapshot()`: every numeric or boolean value
    becomes `trio_router_discovery_<key>`."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        out: list[Metric] = []
        for key, value in sorted(self._snapshot().items()):
            if isinstance(value, bool | int | float) and value is not None:
                name = f"trio_router_discovery_{_metric_name(key)}"
                if name.endswith("_total"):  # a count since start: a counter
                    out.append(
                        CounterMetricFamily(
                            name.removesuffix("_total"), f"Discovery: {key}.", value=float(value)
                        )
                    )
                else:
                    gauge = GaugeMetricFamily(name, f"Discovery status: {key}.")
                    gauge.add_metric([], float(value))
                    out.append(gauge)
        return out


def _metric_name(key: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in key)
