"""Randomized event sequences against an oracle (hypothesis).

Random pod events (add, readiness flips, new IPs, restarts, terminating, eviction, delete),
stream cuts that lose events and end in a relist, and engine probe outcomes that change over
time. After every step the routing table must equal the simple model: one entry per pod in
the watch set, nothing whose DELETED has been applied, nothing routable that Kubernetes says
must not get traffic; and once probes have had time to run, exactly the eligible pods whose
engines answer are routable.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_router.config import ProbeConfig
from trio_router.table import Pod
from trio_router.testing.core import FakeEngines, added, deleted, modified, open_core

PODS = 6
SETTLE_S = 120.0  # > the longest path to routable: capped backoff + deadline + interval

pod_numbers = st.integers(min_value=1, max_value=PODS)
adds = st.tuples(st.just("add"), pod_numbers, st.booleans(), st.booleans())
ops = st.one_of(
    adds,
    adds,
    adds,
    st.tuples(st.just("ready"), pod_numbers, st.booleans()),
    st.tuples(st.just("new_ip"), pod_numbers),
    st.tuples(st.just("restart"), pod_numbers),
    st.tuples(st.just("terminate"), pod_numbers),
    st.tuples(st.just("evict"), pod_numbers, st.sampled_from(["Failed", "Succeeded", ""])),
    st.tuples(st.just("delete"), pod_numbers),
    st.tuples(st.just("cut_and_relist"), st.lists(pod_numbers, max_size=3)),
    st.tuples(st.just("engine"), pod_numbers, st.sampled_from(["ok", "refuse", "hang", "500"])),
    st.tuples(st.just("sleep"), st.sampled_from([0.0, 0.5, 3.0, 12.0, SETTLE_S])),
)


class Oracle:
    def __init__(self) -> None:
        self.pods: dict[str, Pod] = {}
        self.gone: set[str] = set()  # UIDs whose DELETED (or relist without them) was applied
        self.next_ip = 1
        self.generation = 0  # UIDs change when a name is re-created

    def fresh_ip(self) -> str:
        self.next_ip += 1
        return f"127.0.{self.next_ip // 250 + 2}.{self.next_ip % 250 + 1}"

    def uid(self, n: int) -> str | None:
        """Operations other than "add" target the n-th live pod, so few are no-ops."""
        alive = sorted(self.pods)
        return alive[n % len(alive)] if alive else None

    def has_name(self, n: int) -> bool:
        return any(p.name == f"engine-{n}" for p in self.pods.values())


async def run_scenario(steps: list[tuple[Any, ...]]) -> None:
    engines = FakeEngines()
    oracle = Oracle()
    probe = ProbeConfig(timeout_s=5.0, interval_s=10.0, backoff_max_s=30.0)
    async with open_core(engines, probe=probe) as core:
        for step in steps:
            kind = step[0]
            uid = oracle.uid(int(step[1])) if kind not in ("cut_and_relist", "sleep") else None
            pod = oracle.pods.get(uid) if uid else None
            if kind == "add" and not oracle.has_name(int(step[1])):
                n, ready, has_ip = int(step[1]), bool(step[2]), bool(step[3])
                oracle.generation += 1
                pod = Pod(
                    uid=f"uid-{n}-{oracle.generation}",
                    name=f"engine-{n}",
                    ip=oracle.fresh_ip() if has_ip else "",
                    ready=ready,
                    phase="Running" if has_ip else "Pending",
                )
                oracle.pods[pod.uid] = pod
                core.reconciler.apply(added(pod))
            elif kind == "delete" and pod is not None:
                del oracle.pods[pod.uid]
                oracle.gone.add(pod.uid)
                core.reconciler.apply(deleted(pod))
            elif kind == "cut_and_relist":
                # The stream is cut; these pods are deleted while it is down (their DELETED
                # events are lost); the resume ends in 410 and a relist.
                for n in step[1]:
                    if (lost := oracle.uid(int(n))) is not None:
                        del oracle.pods[lost]
                        oracle.gone.add(lost)
                core.reconciler.replace(list(oracle.pods.values()))
            elif kind == "engine":
                ip_pod = oracle.pods.get(uid) if uid else None
                if ip_pod is not None and ip_pod.ip:
                    engines.mode[ip_pod.ip] = str(step[2])
            elif kind == "sleep":
                await trio.sleep(float(step[1]))
            elif pod is not None and kind != "add":
                if kind == "ready":
                    new = replace(pod, ready=bool(step[2]))
                elif kind == "new_ip":
                    new = replace(pod, ip=oracle.fresh_ip(), phase="Running")
                elif kind == "restart":
                    new = replace(pod, restart_count=pod.restart_count + 1)
                elif kind == "terminate":
                    new = replace(pod, terminating=True)
                else:  # evict
                    phase = str(step[2])
                    new = replace(pod, phase=phase) if phase else replace(pod, ip="")
                oracle.pods[pod.uid] = new
                core.reconciler.apply(modified(new))
            check_invariants(core.table, oracle)
        await trio.sleep(SETTLE_S)
        check_invariants(core.table, oracle)
        expected = {
            uid
            for uid, p in oracle.pods.items()
            if p.unroutable_reason() is None and engines.mode.get(p.ip, "ok") == "ok"
        }
        assert {e.uid for e in core.table.routable_engines()} == expected


def check_invariants(table: object, oracle: Oracle) -> None:
    from trio_router.table import RoutingTable

    assert isinstance(table, RoutingTable)
    uids = {e.uid for e in table}
    assert uids == set(oracle.pods), "the table holds exactly the pods in the watch set"
    assert not uids & (oracle.gone - set(oracle.pods)), "a deleted pod is in the table"
    for engine in table.routable_engines():
        pod = oracle.pods[engine.uid]
        assert pod.unroutable_reason() is None, f"{engine.name} routable while {pod}"
        assert engine.url == f"http://{pod.ip}:8000", "routable at a stale address"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(ops, min_size=1, max_size=50))
def test_randomized_event_sequences_against_an_oracle(steps: list[tuple[Any, ...]]) -> None:
    trio.run(run_scenario, steps, clock=trio.testing.MockClock(autojump_threshold=0))
