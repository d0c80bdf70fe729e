"""`GracefulStop`: the first SIGINT/SIGTERM asks for a clean stop, a second or the deadline cancels."""

import asyncio
import os
import signal

import pytest

from asyncrl.shutdown import GracefulStop


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
async def test_first_signal_asks_for_a_clean_stop_and_a_second_cancels(sig):
    asked = []
    main = asyncio.create_task(asyncio.Event().wait())  # stands in for the launcher's main task
    first = asyncio.Event()
    with GracefulStop(lambda: (asked.append(1), first.set()), task=main) as stop:
        os.kill(os.getpid(), sig)
        await asyncio.wait_for(first.wait(), 10)
        assert stop.requested == sig.name and stop.hard is None and not main.done()
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(main, 10)
        assert asked == [1] and stop.hard == "second signal (SIGINT)"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers are put back


async def test_a_clean_stop_past_its_deadline_becomes_immediate():
    main = asyncio.create_task(asyncio.Event().wait())
    with GracefulStop(lambda: None, task=main, deadline_s=0.05) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(main, 10)
        assert "took over 0.05s" in stop.hard


async def test_no_signal_no_stop():
    main = asyncio.create_task(asyncio.sleep(0))
    with GracefulStop(lambda: pytest.fail("no signal was sent"), task=main) as stop:
        await main
    assert stop.requested is None and stop.hard is None
