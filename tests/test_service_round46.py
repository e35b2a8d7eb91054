"""Fewer sends on the controller service's hop to its hosts: a turn's messages to a host in one.

The service's loop sends a host, in one turn, the runs its completions let go: they
go in one batch (``ChannelLink.cork``/``uncork`` around a turn of ``Handoff``), in
the order of the calls, with any other thread's send after what the turn held.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from pathways_jax._src.backends import channel_link
from pathways_jax._src.runtime.serving.handoff import Handoff

_WAIT_S = 30.0


@pytest.fixture
def link(monkeypatch):
    # One machine: the channel listens on IPC, as it does when the Ray cluster is this machine.
    monkeypatch.setattr(channel_link, "listen_on", lambda: ("ipc", "127.0.0.1"))
    made = channel_link.ChannelLink()
    yield made
    made.close()


def _host(link, arrivals: list, *, answer: bool = True):
    """Host 0 of ``link``: notes each message's (kind, args, seq); answers it with None if ``answer``."""
    ends: list = []

    def deliver(kind, args, seq):
        arrivals.append((kind, args, seq))
        if answer:
            ends[0].answer(seq, None)

    ends.append(link.attach(0, None).connect(deliver))
    return ends[0]


def _free(key: int) -> tuple[int, str, tuple]:
    return (0, "free", ([key],))


def test_a_corked_turn_s_messages_to_a_host_go_in_one_send_in_call_order(link):
    arrivals: list = []
    host = _host(link, arrivals)
    try:
        link.send_many(0, [_free(1)])[0].result(timeout=_WAIT_S)  # connected
        batches = link.batches
        link.cork()
        held = link.send_many(0, [_free(2)]) + link.send_many(0, [_free(3), _free(4)])
        assert link.batches == batches  # held: nothing went yet
        # Another thread's send while the turn holds messages goes after them.
        other: list = []
        thread = threading.Thread(target=lambda: other.extend(link.send_many(0, [_free(5)])))
        thread.start()
        thread.join(_WAIT_S)
        assert not thread.is_alive()
        link.send_many(0, [_free(6)])  # the turn's own, after the other thread's
        link.uncork()
        done, _ = concurrent.futures.wait([*held, *other], timeout=_WAIT_S)
        assert len(done) == 4
        assert all(future.result() is None for future in done)
        # The held three and the other thread's: two sends; then the turn's last one: a third.
        assert link.batches == batches + 3
        for future in link.send_many(0, [_free(7)]):
            future.result(timeout=_WAIT_S)
        assert [args[0] for _kind, args, _seq in arrivals] == [[k] for k in range(1, 8)]
    finally:
        host.close()


def test_an_uncorked_send_goes_at_once_and_a_lost_host_s_held_messages_fail(link):
    arrivals: list = []
    host = _host(link, arrivals)
    try:
        link.send_many(0, [_free(1)])[0].result(timeout=_WAIT_S)
        batches = link.batches
        link.send_many(0, [_free(2)])[0].result(timeout=_WAIT_S)
        assert link.batches == batches + 1
        link.cork()
        held = link.send_many(0, [_free(3)])
        link.host_lost(0, "its actor died")
        link.uncork()
        with pytest.raises(channel_link.HostGone):
            held[0].result(timeout=_WAIT_S)
    finally:
        host.close()


def test_a_handoff_turn_calls_its_hooks_once_around_the_calls_it_runs():
    loop = asyncio.new_event_loop()
    try:
        seen: list = []
        handoff = Handoff(loop, (lambda: seen.append("cork"), lambda: seen.append("uncork")))
        for index in range(3):
            handoff.post(seen.append, index)
        handoff.post(loop.stop)
        loop.run_forever()
        assert seen == ["cork", 0, 1, 2, "uncork"]

        def boom() -> None:
            raise RuntimeError("a call's bug")

        errors: list = []
        loop.set_exception_handler(lambda _loop, context: errors.append(context["exception"]))
        seen.clear()
        handoff.post(boom)
        handoff.post(seen.append, "after")
        handoff.post(loop.stop)
        loop.run_forever()
        assert seen == ["cork", "after", "uncork"]
        assert [str(exc) for exc in errors] == ["a call's bug"]
    finally:
        loop.close()
