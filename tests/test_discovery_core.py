"""The discovery core on virtual time: reconciler + per-engine supervisors + routing table.

Each test is named after the discovery guarantee it proves.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from trio_router.config import ProbeConfig, StaticConfig
from trio_router.discovery.supervision import ProbeFailed, Prober, parse_models
from trio_router.http import UpstreamPool
from trio_router.table import Engine, EngineState, Model, RoutingTable
from trio_router.testing.core import FakeEngines, added, deleted, make_pod, modified, open_core


async def test_deleted_is_never_stuck_behind_probes(autojump_clock: trio.testing.MockClock) -> None:
    """Nine engines hang in /v1/models; the tenth is deleted (and, separately, a pod is
    marked terminating): it leaves routing in the same synchronous step, at the same instant."""
    engines = FakeEngines(mode={f"127.0.1.{n}": "hang" for n in range(1, 10)})
    async with open_core(engines) as core:
        for n in range(1, 11):
            core.reconciler.apply(added(make_pod(n)))
        await core.wait_until("routable", "uid-10")
        assert [e.name for e in core.table.routable("m")] == ["engine-10"]

        before = trio.current_time()
        core.reconciler.apply(deleted(make_pod(10)))
        # No await happened: the next request can only see the table as it is now.
        assert core.table.routable("m") == ()
        assert core.table.get("uid-10") is None
        assert trio.current_time() == before
        assert len(core.supervisors) == 9  # the hanging probes are untouched

        core.reconciler.apply(added(make_pod(11)))
        await core.wait_until("routable", "uid-11")
        core.reconciler.apply(modified(make_pod(11, terminating=True)))
        assert core.table.routable("m") == ()


async def test_scale_up_bursts_probe_concurrently(autojump_clock: trio.testing.MockClock) -> None:
    """50 pods become Ready within 1 s and every probe takes 2 s: all are routable about
    2 s after the last one arrived, and events are applied without waiting on probes."""
    engines = FakeEngines(mode={f"127.0.1.{n}": "slow:2" for n in range(1, 51)})
    async with open_core(engines) as core:
        start = trio.current_time()
        for n in range(1, 51):
            core.reconciler.apply(added(make_pod(n)))
            assert trio.current_time() - start < 1.0  # applying never waits for a probe
            await trio.sleep(0.02)
        await core.wait_until("routable", *(f"uid-{n}" for n in range(1, 51)))
        assert len(core.table.routable("m")) == 50
        assert trio.current_time() - start == pytest.approx(0.98 + 2.0, abs=0.05)


async def test_no_resurrection(autojump_clock: trio.testing.MockClock) -> None:
    """A probe that completes just after its pod was deleted (or replaced by a newer
    generation) does not re-add it."""
    engines = FakeEngines(mode={"127.0.1.1": "slow:1"})
    async with open_core(engines) as core:
        core.reconciler.apply(added(make_pod(1)))
        await trio.sleep(0.5)  # the probe is in flight
        core.reconciler.apply(deleted(make_pod(1)))
        await trio.sleep(5)
        assert core.table.get("uid-1") is None
        assert len(core.supervisors) == 0

    # The guard itself: a result from an older generation is refused by the table.
    table = RoutingTable()
    async with open_core() as core:
        table = core.table
        core.reconciler.apply(added(make_pod(2)))
        await core.wait_until("routable", "uid-2")
        core.reconciler.apply(modified(make_pod(2, ready=False)))
        core.reconciler.apply(modified(make_pod(2)))  # back to Ready: a new generation
        engine = table.get("uid-2")
        assert engine is not None and engine.generation == 1
        assert not table.mark_routable("uid-2", 0, [Model("m")])
        assert not table.mark_routable("uid-gone", 0, [Model("m")])
        assert engine.state is EngineState.PROBING


async def test_terminating_means_gone_for_routing(autojump_clock: trio.testing.MockClock) -> None:
    """DeletionTimestamp set -> out of routing at once, probes stop; requests already in
    flight to it are not touched by discovery."""
    async with open_core() as core:
        core.reconciler.apply(added(make_pod(1)))
        core.reconciler.apply(added(make_pod(2)))
        await core.wait_until("routable", "uid-1", "uid-2")
        engine = core.table.get("uid-1")
        assert engine is not None
        engine.in_flight = 3  # as the request path would have it
        core.reconciler.apply(modified(make_pod(1, terminating=True)))
        assert [e.uid for e in core.table.routable("m")] == ["uid-2"]
        assert engine.state is EngineState.PENDING and engine.reason == "terminating"
        assert engine.in_flight == 3
        probes = core.engines.probes["127.0.1.1"]
        await trio.sleep(60)
        assert core.engines.probes["127.0.1.1"] == probes  # no probing a terminating pod


@dataclass(eq=False)
class Heard:
    """A stream registered at an engine (`Engine.streams`): what it was told, and whether
    its engine was out of routing by then."""

    table: RoutingTable
    told: list[tuple[str, str, bool]] = field(default_factory=list)

    def engine_leaving(self, engine: Engine, why: str) -> None:
        self.told.append((engine.name, why, engine not in self.table.routable("m")))


async def test_streams_hear_at_once_that_their_engine_is_going_away(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The streams in flight at an engine are told in the same step that takes it out of
    routing, when its pod is going away: terminating, deleted, missing from a LIST, its
    containers ended. Not Ready, phase Unknown, a port no longer served or the pods' source
    gone take the engine out of routing but tell its streams nothing."""
    async with open_core() as core:
        for n in range(1, 6):
            core.reconciler.apply(added(make_pod(n)))
        await core.wait_until("routable", *(f"uid-{n}" for n in range(1, 6)))
        heard = Heard(core.table)
        for engine in core.table:
            engine.streams.add(heard)
        core.reconciler.apply(modified(make_pod(1, ready=False)))
        core.reconciler.apply(modified(make_pod(2, phase="Unknown")))
        assert heard.told == []
        core.reconciler.apply(modified(make_pod(1, ready=False, terminating=True)))
        core.reconciler.apply(deleted(make_pod(1)))  # told again: a stream may go now
        core.reconciler.apply(deleted(make_pod(3)))
        core.reconciler.apply(modified(make_pod(4, phase="Failed")))
        assert heard.told == [
            ("engine-1", "terminating", True),
            ("engine-1", "deleted", True),
            ("engine-3", "deleted", True),
            ("engine-4", "phase Failed", True),
        ]
        heard.told.clear()
        core.reconciler.replace([make_pod(2), make_pod(4, phase="Failed")])  # 5 is gone
        assert heard.told == [
            ("engine-5", "missing from LIST", True),
            ("engine-4", "phase Failed", True),  # each event about it tells again
        ]
        heard.told.clear()
        core.reconciler.apply(added(make_pod(6)))
        core.reconciler.clear("the InferencePool is gone")
        core.reconciler.set_ports([9000])
        assert heard.told == []


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"phase": "Failed"}, "phase Failed"),
        ({"phase": "Succeeded"}, "phase Succeeded"),
        ({"phase": "Unknown"}, "phase Unknown"),
        ({"ip": ""}, "no pod IP"),
    ],
)
async def test_evicted_pods(
    autojump_clock: trio.testing.MockClock, change: dict[str, str], reason: str
) -> None:
    """An empty podIP or phase Failed/Succeeded removes the pod even with Ready True."""
    async with open_core() as core:
        core.reconciler.apply(added(make_pod(1)))
        await core.wait_until("routable", "uid-1")
        core.reconciler.apply(modified(make_pod(1, ready=True, **change)))  # type: ignore[arg-type]
        assert core.table.routable("m") == ()
        engine = core.table.get("uid-1")
        assert engine is not None and engine.reason == reason


async def test_pods_without_an_ip(autojump_clock: trio.testing.MockClock) -> None:
    """A pod with no IP is tolerated; it becomes routable only after Ready + a probe."""
    engines = FakeEngines(mode={"127.0.1.1": "slow:1"})
    async with open_core(engines) as core:
        core.reconciler.apply(added(make_pod(1, ready=False, ip="", phase="Pending")))
        engine = core.table.get("uid-1")
        assert engine is not None and engine.state is EngineState.PENDING
        assert engine.describe()["url"] == ""
        core.reconciler.apply(modified(make_pod(1, ready=False)))  # IP assigned, not Ready yet
        await trio.sleep(30)
        assert core.engines.probes["127.0.1.1"] == 0  # not Ready: no probing needed
        core.reconciler.apply(modified(make_pod(1)))
        assert engine.describe()["state"] == "probing" and core.table.routable("m") == ()
        start = trio.current_time()
        await core.wait_until("routable", "uid-1")
        assert trio.current_time() - start == pytest.approx(1.0)


async def test_one_probe_failure_then_recovery(autojump_clock: trio.testing.MockClock) -> None:
    """After a failure and then recovery, with no Kubernetes event, the engine is
    routable again within interval_s + timeout_s; and no pod is ever dropped for good."""
    probe = ProbeConfig(timeout_s=5.0, interval_s=10.0, backoff_max_s=30.0)
    engines = FakeEngines()
    async with open_core(engines, probe=probe) as core:
        core.reconciler.apply(added(make_pod(1)))
        await core.wait_until("routable", "uid-1")
        engines.mode["127.0.1.1"] = "refuse"
        await core.wait_until("unroutable", "uid-1")
        engines.mode["127.0.1.1"] = "ok"
        recovered = trio.current_time()
        await core.wait_until("routable", "uid-1")
        assert trio.current_time() - recovered <= probe.interval_s + probe.timeout_s

        # A long outage: still probed (with capped backoff), and back once it answers.
        engines.mode["127.0.1.1"] = "hang"
        await core.wait_until("unroutable", "uid-1")
        await trio.sleep(3600)
        count = engines.probes["127.0.1.1"]
        await trio.sleep(600)
        # capped backoff: at least one probe per (backoff_max_s * 1.1 + timeout_s)
        assert engines.probes["127.0.1.1"] - count >= 600 // (30 * 1.1 + 5)
        engines.mode["127.0.1.1"] = "ok"
        recovered = trio.current_time()
        await core.wait_until("routable", "uid-1")
        assert trio.current_time() - recovered <= probe.backoff_max_s * 1.1 + probe.timeout_s


async def test_single_probe_failure_does_not_eject(autojump_clock: trio.testing.MockClock) -> None:
    """A routable engine that fails one probe (not a refused connection) stays routable until
    `failures_to_eject` consecutive failures."""
    engines = FakeEngines()
    async with open_core(engines, probe=ProbeConfig(failures_to_eject=2)) as core:
        core.reconciler.apply(added(make_pod(1)))
        await core.wait_until("routable", "uid-1")
        engines.mode["127.0.1.1"] = "500"
        count = engines.probes["127.0.1.1"]
        while engines.probes["127.0.1.1"] == count:
            await core.table.wait_changed()
        engine = core.table.get("uid-1")
        assert engine is not None and engine.routable and engine.consecutive_failures == 1
        await core.wait_until("unroutable", "uid-1")
        assert engine.consecutive_failures == 2
        assert engine.reason == "GET /v1/models answered 500"


@pytest.mark.parametrize("mode", ["hang", "drip"])
async def test_hung_or_slow_drip_probes(autojump_clock: trio.testing.MockClock, mode: str) -> None:
    """A hung or slow-drip probe is abandoned at timeout_s of wall time (a deadline, not
    a per-read timeout), affects no other engine, and uses no thread."""
    threads = threading.active_count()
    engines = FakeEngines(mode={"127.0.1.1": mode})
    network = engines.network()
    async with network.open():
        pool = UpstreamPool(
            connect_timeout=math.inf, read_timeout=math.inf, connect=network.connect
        )
        start = trio.current_time()
        with pytest.raises(ProbeFailed, match="no answer within 5 s"):
            await Prober(timeout=5.0).probe(pool, "http://127.0.1.1:8000")
        assert trio.current_time() - start == pytest.approx(5.0)

    async with open_core(engines) as core:
        core.reconciler.apply(added(make_pod(1)))
        core.reconciler.apply(added(make_pod(2)))
        await core.wait_until("routable", "uid-2")
        await trio.sleep(120)
        assert [e.uid for e in core.table.routable("m")] == ["uid-2"]
        assert engines.probes["127.0.1.1"] >= 3  # abandoned and retried, never stuck
    assert threading.active_count() == threads


async def test_unreachable_on_the_wire(autojump_clock: trio.testing.MockClock) -> None:
    """A pod that Kubernetes calls Ready but that refuses connections
    is ejected by its first failed probe; a failed request reported by the proxy ejects it at
    once and triggers an immediate re-probe."""
    engines = FakeEngines(mode={"127.0.1.1": "refuse"})
    async with open_core(engines) as core:
        core.reconciler.apply(added(make_pod(1)))
        core.reconciler.apply(added(make_pod(2)))
        await core.wait_until("routable", "uid-2")
        await trio.sleep(1)
        engine1 = core.table.get("uid-1")
        assert engine1 is not None and engine1.state is EngineState.UNHEALTHY
        assert "cannot connect" in engine1.reason

        engine2 = core.table.get("uid-2")
        assert engine2 is not None
        count = engines.probes["127.0.1.2"]
        engines.mode["127.0.1.2"] = "refuse"
        start = trio.current_time()
        core.supervisors.outliers.report_unreachable(engine2, engine2.generation, "connect refused")
        assert core.table.routable("m") == ()  # ejected in the same step
        while engines.probes["127.0.1.2"] == count:
            await core.table.wait_changed()
        assert trio.current_time() - start < 0.01  # re-probed now, not at the next interval


async def test_container_restart(autojump_clock: trio.testing.MockClock) -> None:
    """Out at Ready=False; back after Ready=True plus a probe that refreshes models."""
    engines = FakeEngines(models={"127.0.1.1": ["base"]})
    async with open_core(engines) as core:
        core.reconciler.apply(added(make_pod(1)))
        await core.wait_until("routable", "uid-1")
        core.reconciler.apply(modified(make_pod(1, ready=False, restarts=1)))
        assert core.table.routable("base") == ()
        engines.models["127.0.1.1"] = ["base", "lora-a"]
        core.reconciler.apply(modified(make_pod(1, restarts=1)))
        assert core.table.routable("base") == ()  # not before a fresh probe
        await core.wait_until("routable", "uid-1")
        assert [e.uid for e in core.table.routable("lora-a")] == ["uid-1"]

        # A restart seen only as restartCount rising (Ready stayed True) also re-probes.
        engines.models["127.0.1.1"] = ["base"]
        core.reconciler.apply(modified(make_pod(1, restarts=2)))
        assert core.table.routable("base") == ()
        await core.wait_until("routable", "uid-1")
        assert core.table.routable("lora-a") == ()


async def test_unchanged_modified_triggers_no_probe(autojump_clock: trio.testing.MockClock) -> None:
    """A MODIFIED or a relist that changes nothing routing depends on keeps the
    engine routable and starts no probe."""
    async with open_core() as core:
        core.reconciler.apply(added(make_pod(1)))
        await core.wait_until("routable", "uid-1")
        count = core.engines.probes["127.0.1.1"]
        version = core.table.version
        core.reconciler.apply(modified(make_pod(1)))
        core.reconciler.replace([make_pod(1)])
        await trio.sleep(1)
        assert core.engines.probes["127.0.1.1"] == count
        assert core.table.version == version


async def test_relist_reconciles_by_difference(autojump_clock: trio.testing.MockClock) -> None:
    """Pods missing from a new LIST are removed, new ones probed and
    added, unchanged ones never leave the table; a name whose UID changed is a delete + add."""
    async with open_core() as core:
        for n in (1, 2, 3):
            core.reconciler.apply(added(make_pod(n)))
        await core.wait_until("routable", "uid-1", "uid-2", "uid-3")
        replacement = make_pod(4, ip="127.0.1.3")
        replacement = type(replacement)(uid="uid-3b", name="engine-3", ip="127.0.1.3", ready=True)
        core.reconciler.replace([make_pod(1), make_pod(5), replacement])
        assert {e.uid for e in core.table.routable("m")} == {"uid-1"}
        assert core.table.get("uid-2") is None and core.table.get("uid-3") is None
        await core.wait_until("routable", "uid-5", "uid-3b")
        assert {e.uid for e in core.table.routable("m")} == {"uid-1", "uid-5", "uid-3b"}


async def test_one_address_routes_to_one_entry(autojump_clock: trio.testing.MockClock) -> None:
    """An IP may map to several UIDs; only one routable entry per address is used."""
    async with open_core() as core:
        core.reconciler.apply(added(make_pod(1)))
        other = type(make_pod(1))(uid="uid-x", name="engine-x", ip="127.0.1.1", ready=True)
        core.reconciler.apply(added(other))
        await core.wait_until("routable", "uid-1", "uid-x")
        assert [e.uid for e in core.table.routable("m")] == ["uid-x"]


def test_parse_models_rejects_bad_answers() -> None:
    with pytest.raises(ProbeFailed, match="no models"):
        parse_models({"data": []})
    with pytest.raises(ProbeFailed, match='no "data" list'):
        parse_models(["m"])
    with pytest.raises(ProbeFailed, match="without a string id"):
        parse_models({"data": [{"id": 3}]})
    models = parse_models(
        {
            "data": [
                {"id": "base", "max_model_len": 4096},
                {"id": "lora", "parent": "base", "root": "/a"},
            ]
        }
    )
    assert models == [Model("base", max_model_len=4096), Model("lora", parent="base", root="/a")]


async def test_static_engines(autojump_clock: trio.testing.MockClock) -> None:
    """Static discovery: the same supervisors for fixed URLs."""
    from trio_router.discovery.reconcile import add_static_engines

    async with open_core() as core:
        add_static_engines(
            core.table,
            core.supervisors,
            StaticConfig.from_urls(["http://127.0.1.7:8000/", "http://127.0.1.8:8000"]).urls,
        )
        await core.wait_until("routable", "http://127.0.1.7:8000", "http://127.0.1.8:8000")
        assert sorted(e.name for e in core.table.routable("m")) == [
            "127.0.1.7:8000",
            "127.0.1.8:8000",
        ]


async def test_ipv6_and_malformed_addresses(autojump_clock: trio.testing.MockClock) -> None:
    """IPv6 pod IPs get brackets; an address no URL can hold fails its probe, and the other
    engines carry on."""
    async with open_core() as core:
        core.reconciler.apply(added(make_pod(1, ip="fd00::1")))
        core.reconciler.apply(added(make_pod(2, ip="999.1.1.1")))
        core.reconciler.apply(added(make_pod(3)))
        await core.wait_until("routable", "uid-1", "uid-3")
        engine1, engine2 = core.table.get("uid-1"), core.table.get("uid-2")
        assert engine1 is not None and engine1.url == "http://[fd00::1]:8000"
        assert engine2 is not None and engine2.state is EngineState.UNHEALTHY
        assert "cannot resolve engine http://999.1.1.1:8000" in engine2.reason


async def test_probe_settings_change_live(autojump_clock: trio.testing.MockClock) -> None:
    """A config reload's new probe interval and deadline apply from each engine's next probe,
    without restarting supervisors."""
    engines = FakeEngines()
    async with open_core(engines, probe=ProbeConfig(interval_s=10.0)) as core:
        core.reconciler.apply(added(make_pod(1)))
        await core.wait_until("routable", "uid-1")
        await trio.sleep(100)
        slow = engines.probes["127.0.1.1"]
        assert 9 <= slow <= 12
        core.supervisors.update_config(ProbeConfig(interval_s=1.0, timeout_s=2.0))
        await trio.sleep(100 + 11)  # the wait already begun may last one old interval
        assert engines.probes["127.0.1.1"] - slow >= 90
        engines.mode["127.0.1.1"] = "hang"
        start = trio.current_time()
        await core.wait_until("unroutable", "uid-1")  # two failures of 2 s, not 5 s
        assert trio.current_time() - start < 1.1 + 2 + 1.1 + 2 + 0.1


async def test_each_engine_keeps_its_own_connection(autojump_clock: trio.testing.MockClock) -> None:
    """Every engine's probes reuse one kept-alive connection of its own; a DELETED closes it
    (and the connection of a probe that hangs) in the same step that cancels the scope."""
    engines = FakeEngines(mode={"127.0.1.3": "hang"})
    async with open_core(engines) as core:
        for n in (1, 2, 3):
            core.reconciler.apply(added(make_pod(n)))
        await core.wait_until("routable", "uid-1", "uid-2")
        await trio.sleep(100)
        assert engines.probes["127.0.1.1"] >= 9 and engines.probes["127.0.1.2"] >= 9
        assert core.network.connections["127.0.1.1"] == 1
        assert core.network.connections["127.0.1.2"] == 1
        await core.network.wait_for(lambda: core.network.open_now["127.0.1.3"] == 1)

        core.reconciler.apply(deleted(make_pod(1)))
        core.reconciler.apply(deleted(make_pod(3)))
        with trio.fail_after(0.1):  # the engines see their connections close at once
            await core.network.wait_for(
                lambda: core.network.open_now == {"127.0.1.1": 0, "127.0.1.2": 1, "127.0.1.3": 0}
            )


async def test_healthy_engines_are_never_ejected_because_others_hang(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With far more hanging engines than probe slots (`probe.max_concurrent`), a healthy
    engine waits for a slot but its probe deadline starts only when it is sent: it becomes
    routable, and no probe of it ever fails."""
    hanging = {f"127.0.2.{n}": "hang" for n in range(1, 41)}
    engines = FakeEngines(mode=hanging)
    probe = ProbeConfig(timeout_s=5.0, interval_s=10.0, max_concurrent=4)
    async with open_core(engines, probe=probe) as core:
        for n in range(1, 41):
            core.reconciler.apply(added(make_pod(100 + n, ip=f"127.0.2.{n}")))
        # Every probe slot is taken by a hanging engine before the healthy one comes.
        await core.network.wait_for(lambda: sum(core.network.open_now.values()) == 4)
        core.reconciler.apply(added(make_pod(1)))
        await core.wait_until("routable", "uid-1")
        assert trio.current_time() > probe.timeout_s  # it did wait behind hanging probes
        healthy = core.table.get("uid-1")
        assert healthy is not None
        for _ in range(600):
            await trio.sleep(1)
            assert healthy.routable and healthy.consecutive_failures == 0, healthy.reason
        assert engines.probes["127.0.1.1"] >= 10
        assert max(engines.probes[ip] for ip in hanging) >= 3  # the others are still probed


def test_a_relisting_that_only_restamps_its_cards_changes_nothing() -> None:
    """vLLM stamps every /v1/models listing with the time of the request: a re-probe that finds
    the same models must not count as a change of the table (every cache keyed on its version
    would be rebuilt on every probe of every engine)."""
    table = RoutingTable()
    table.put(Engine(uid="u", name="e", url="http://127.0.1.1:8000"))

    def listing(created: int, *ids: str) -> list[Model]:
        cards = [{"id": i, "object": "model", "created": created, "permission": []} for i in ids]
        return parse_models({"object": "list", "data": cards})

    assert table.mark_routable("u", 0, listing(1, "m"))
    version = table.version
    assert table.mark_routable("u", 0, listing(2, "m"))
    assert table.version == version
    assert table.models()[0].as_openai() == {
        "id": "m",
        "object": "model",
        "created": 1,
        "permission": [],
    }  # the card as the engine first listed it
    assert table.mark_routable("u", 0, listing(3, "m", "lora"))
    assert table.version > version


async def test_traffic_vouches_for_an_engine_its_probes_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An engine whose requests are answered is not probed for its health; its model list is
    still re-read every `probe.refresh_s`. Once its traffic stops, it is probed every
    `interval_s` again. An idle engine beside it is probed every `interval_s` throughout."""
    probe = ProbeConfig(timeout_s=5.0, interval_s=10.0, refresh_s=60.0)
    engines = FakeEngines()
    async with open_core(engines, probe=probe) as core:
        core.reconciler.apply(added(make_pod(1)))
        core.reconciler.apply(added(make_pod(2)))
        await core.wait_until("routable", "uid-1", "uid-2")
        busy = core.table.get("uid-1")
        assert busy is not None
        start = trio.current_time()
        for _ in range(55):  # a request answered every second
            core.supervisors.outliers.request_succeeded(busy)
            await trio.sleep(1)
        assert engines.probes["127.0.1.1"] == 1  # the first probe only
        assert engines.probes["127.0.1.2"] >= 5  # the idle one: every interval_s
        for _ in range(10):
            core.supervisors.outliers.request_succeeded(busy)
            await trio.sleep(1)
        # Its model list: re-read once refresh_s after its last probe.
        assert engines.probes["127.0.1.1"] == 2
        assert trio.current_time() - start < 2 * probe.refresh_s
        count = engines.probes["127.0.1.1"]
        await trio.sleep(30)  # no more traffic: probed every interval_s
        assert 2 <= engines.probes["127.0.1.1"] - count <= 4


async def test_a_failed_request_still_ejects_and_reprobes_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Traffic's word is taken back by a failed request: an engine its traffic vouches for,
    found unreachable, is ejected and probed at once, not at its next probe."""
    engines = FakeEngines()
    async with open_core(engines) as core:
        core.reconciler.apply(added(make_pod(1)))
        await core.wait_until("routable", "uid-1")
        engine = core.table.get("uid-1")
        assert engine is not None
        for _ in range(30):
            core.supervisors.outliers.request_succeeded(engine)
            await trio.sleep(1)
        count = engines.probes["127.0.1.1"]
        engines.mode["127.0.1.1"] = "refuse"
        core.supervisors.outliers.report_unreachable(engine, engine.generation, "refused")
        assert not engine.routable
        with trio.fail_after(0.01):  # its failed probe is written to the table at once
            while engines.probes["127.0.1.1"] == count:
                await core.table.wait_changed()
        engines.mode["127.0.1.1"] = "ok"
        await core.wait_until("routable", "uid-1")


async def test_routine_probes_are_paced_across_engines(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`probe.max_per_s` bounds the routine re-probes of routable engines, so idle probing
    costs the same at any number of engines (each engine's period stretches instead); first
    probes and a failing engine's re-probes are never held back by it."""
    probe = ProbeConfig(timeout_s=5.0, interval_s=10.0, backoff_max_s=4.0, max_per_s=2.0)
    engines = FakeEngines()
    async with open_core(engines, probe=probe) as core:
        for n in range(1, 101):
            core.reconciler.apply(added(make_pod(n, ip=f"127.0.2.{n}")))
        with trio.fail_after(probe.timeout_s):  # first probes: all at once
            await core.wait_until("routable", *(f"uid-{n}" for n in range(1, 101)))
        await trio.sleep(100)
        before = sum(engines.probes.values())
        await trio.sleep(100)
        assert 180 <= sum(engines.probes.values()) - before <= 202  # 2 a second
        # Every engine still gets its turn: about every 100 / 2 = 50 s.
        counts = dict(engines.probes)
        await trio.sleep(60)
        assert all(engines.probes[ip] > counts[ip] for ip in counts)

        engines.mode["127.0.2.7"] = "500"  # failing: re-probed with backoff, not in turn
        failing = core.table.get("uid-7")
        assert failing is not None
        while failing.consecutive_failures == 0:
            await core.table.wait_changed()
        failed_at = trio.current_time()
        while failing.routable:
            await core.table.wait_changed()
        assert trio.current_time() - failed_at <= 1.1 * 1.0 + 0.01  # backoff, not 50 s
        count = engines.probes["127.0.2.7"]
        await trio.sleep(30)
        assert engines.probes["127.0.2.7"] - count >= 30 // (probe.backoff_max_s * 1.1)
