"""The emulated API server's timeline: arrivals handled in rounds, outputs in order."""

from __future__ import annotations

import pytest

from trio_router.emulator.front_end import FrontEnd
from trio_router.emulator.profiles import FrontEndCost
from trio_router.emulator.request import Request

COST = FrontEndCost(arrival_s=0.002, per_output_s=0.001, per_output_token_s=0.0001)


def request(name: str) -> Request:
    return Request(request_id=name, token_ids=[16, 17], max_tokens=4, arrival_time=0.0)


def test_a_lone_arrival_reaches_the_core_after_its_own_work() -> None:
    front = FrontEnd(COST, time_scale=1.0)
    front.arrive(request("a"), 1.0)
    assert front.next_arrival() == pytest.approx(1.002)
    assert front.arrived(1.0019) == []
    assert [r.request_id for r in front.arrived(1.002)] == ["a"]
    assert front.reached["a"] == pytest.approx(1.002)


def test_arrivals_while_it_handles_arrivals_go_on_together() -> None:
    # The event loop interleaves requests that came while it was busy with others: they
    # progress together and reach the engine core together, after all their work.
    front = FrontEnd(COST, time_scale=1.0)
    for i, now in enumerate([1.0, 1.0, 1.0005, 1.001]):
        front.arrive(request(f"r{i}"), now)
    assert front.next_arrival() == pytest.approx(1.008)
    assert front.arrived(1.0079) == []
    assert [r.request_id for r in front.arrived(1.008)] == ["r0", "r1", "r2", "r3"]


def test_an_arrival_once_it_is_idle_starts_a_round_of_its_own() -> None:
    front = FrontEnd(COST, time_scale=1.0)
    front.arrive(request("a"), 1.0)
    front.arrive(request("b"), 1.003)  # the first round ended at 1.002
    assert [r.request_id for r in front.arrived(1.002)] == ["a"]
    assert front.next_arrival() == pytest.approx(1.005)


def test_output_work_closes_the_round_and_later_arrivals_wait_behind_it() -> None:
    front = FrontEnd(COST, time_scale=1.0)
    front.arrive(request("a"), 1.0)
    ready = front.output(1.001, tokens=10)  # a step's output, queued behind the round
    assert ready == pytest.approx(1.002 + 0.002)
    front.arrive(request("b"), 1.0015)
    assert [r.request_id for r in front.arrived(1.002)] == ["a"]  # its round did not grow
    assert front.next_arrival() == pytest.approx(1.004 + 0.002)


def test_the_round_follows_the_time_scale() -> None:
    front = FrontEnd(COST, time_scale=0.5)  # emulated seconds per second of Trio's clock
    front.arrive(request("a"), 1.0)
    front.arrive(request("b"), 1.0)
    assert front.next_arrival() == pytest.approx(1.008)
    front.arrived(1.008)
    assert front.reached["b"] == pytest.approx(1.008 * 0.5)


def test_a_request_given_up_in_its_round_leaves_the_others_together() -> None:
    front = FrontEnd(COST, time_scale=1.0)
    first, second = request("a"), request("b")
    front.arrive(first, 1.0)
    front.arrive(second, 1.0)
    assert front.remove(first)
    front.arrive(request("c"), 1.001)  # joins what is left of the round
    assert front.next_arrival() == pytest.approx(1.006)  # the round's work was queued
    assert [r.request_id for r in front.arrived(1.006)] == ["b", "c"]
    assert not front.remove(first)


def test_a_step_that_finishes_requests_costs_their_ends_too() -> None:
    """`finish_s` per request a step's output ends (the end of its response), worked on
    once the step's tokens are out: what is queued after it waits for it."""
    cost = FrontEndCost(per_output_s=0.001, per_output_token_s=0.0001, finish_s=0.002)
    front = FrontEnd(cost, time_scale=1.0)
    assert front.output(1.0, tokens=4) == pytest.approx(1.0014)
    assert front.output(1.01, tokens=4, finished=3) == pytest.approx(1.0114)
    front.arrive(request("a"), 1.012)  # behind the three ends' work (no arrival cost)
    assert front.next_arrival() == pytest.approx(1.0174)
    assert front.output(1.013, tokens=1) == pytest.approx(1.0174 + 0.0011)
    assert FrontEndCost(finish_s=0.001)  # a front end of its own
    assert not FrontEndCost()
