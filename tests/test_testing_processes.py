"""trio_router.testing.processes: a process's output waited on."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_router.testing.processes import Output


async def test_wait_count_waits_for_the_count_and_fails_when_the_output_ends() -> None:
    send, receive = trio.testing.memory_stream_one_way_pair()
    output = Output()
    seen: list[int] = []

    async def waiter() -> None:
        await output.wait_count("is routable", 64)
        seen.append(output.text.count("is routable"))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(output.pump, receive)
            nursery.start_soon(waiter)
            for i in range(63):
                await send.send_all(b"engine %d is routable\n" % i)
                await trio.testing.wait_all_tasks_blocked()
            assert seen == []  # one short
            await send.send_all(b"engine 63 is routable\n")
            await trio.testing.wait_all_tasks_blocked()
            assert seen == [64]
            await send.aclose()
    with pytest.raises(AssertionError, match="fewer than 65 'is routable'"):
        await output.wait_count("is routable", 65)
