"""`routing.pending`: the prefill each engine was sent and has not begun to answer."""

from __future__ import annotations

from trio_router.routing.pending import Pending


def test_pending_tokens_end_at_their_release_or_their_end_whichever_comes_first() -> None:
    pending = Pending()
    a = pending.add("e1", 1000, now=0.0, until=2.0)
    pending.add("e1", 200, now=0.5, until=2.5)
    pending.add("e2", 300, now=0.5, until=1.0)
    assert pending.add("e2", 0, now=0.5, until=9.0) is not None  # nothing to prefill
    assert (pending.of("e1", 0.6), pending.of("e2", 0.6)) == (1200, 300)
    a()
    a()  # a second release changes nothing
    assert pending.of("e1", 0.6) == 200
    assert pending.of("e2", 1.0) == 0  # its end came
    assert pending.of("e1", 1.0) == 200
    assert pending.of("e1", 2.5) == 0


def test_a_forgotten_engine_has_nothing_pending_and_late_releases_are_harmless() -> None:
    pending = Pending()
    release = pending.add("gone", 500, now=0.0, until=10.0)
    pending.add("kept", 100, now=0.0, until=10.0)
    pending.forget("gone")
    assert pending.of("gone", 1.0) == 0
    release()
    assert pending.of("gone", 1.0) == 0 and pending.of("kept", 1.0) == 100
    assert pending.of("kept", 11.0) == 0  # its end still comes
