"""How the controller's message of a run reaches the run's hosts: one after another, a tree, or a broadcast.

``"serial"`` (what the runtime does today): the controller's thread sends every
host its message, one after another, ``hosts.message_s`` each: a run costs the
controller ``H`` messages for ``H`` hosts.

``"tree"`` (a k-nomial broadcast tree, as MPI's broadcast): in rounds, every
sender that holds the run's message (the controller, and every host it has
reached) sends it on to ``k`` hosts not reached yet, so after ``r`` rounds
``(k + 1) ** r - 1`` hosts have it. The controller sends ``k`` messages a round,
``k * ceil(log_{k+1}(H + 1))`` in all; a host forwards on its own thread before
it walks its own part; the last host is ``ceil(log_{k+1}(H + 1))`` hops away,
each hop adding ``hosts.latency_s`` and the sender's ``message_s`` per message
sent before it. A forwarded message carries the parts of every host below it,
charged as one message (a message's cost is its overhead, not its few bytes:
``benchmarks/wire.py``).

``"broadcast"`` (what the runtime does over its channel, ``wire.Server.broadcast``):
the controller sends ONE message carrying every host's part, paying
``hosts.broadcast_s`` once and ``hosts.broadcast_host_s`` per host (encoding
that host's part); ZeroMQ's I/O thread copies it to every host, each host
``hosts.latency_s`` away, with no forwarding (``benchmarks/fanout.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

Fanout = Literal["serial", "tree", "broadcast"]
FANOUTS: tuple[Fanout, ...] = ("serial", "tree", "broadcast")
CONTROLLER = -1  # the sender that is not a host


def fanout_tree(hosts: Sequence[int], fanout: Fanout, degree: int) -> dict[int, tuple[int, ...]]:
    """Who sends the run's message to whom: ``{sender: receivers in sending order}``.

    ``CONTROLLER`` (-1) is the controller; every host of ``hosts`` is a receiver
    exactly once. Senders that send nothing are left out.

    Example:
      >>> fanout_tree([0, 1, 2], "serial", 2)
      {-1: (0, 1, 2)}
      >>> fanout_tree(range(8), "tree", 2)
      {-1: (0, 1, 2, 3), 0: (4, 5), 1: (6, 7)}
    """
    order = list(hosts)
    if fanout in ("serial", "broadcast"):
        return {CONTROLLER: tuple(order)} if order else {}
    children: dict[int, list[int]] = {}
    holders, reached = [CONTROLLER], 0
    while reached < len(order):
        new = []
        for sender in holders:  # one round: every holder sends to `degree` hosts not reached yet
            for _ in range(degree):
                if reached == len(order):
                    break
                children.setdefault(sender, []).append(order[reached])
                new.append(order[reached])
                reached += 1
        holders += new
    return {sender: tuple(to) for sender, to in children.items()}
