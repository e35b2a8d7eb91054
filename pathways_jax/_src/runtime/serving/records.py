"""What a controller service keeps of each client process and of each batch it sent."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the channels need the ray extra (pyzmq, msgspec): imported where used
    from pathways_jax._src import wire


@dataclasses.dataclass(eq=False)
class Batch:
    """A client's numbered batch: its messages (``wire.Routed``) and what the scheduler needs.

    ``reply(answers)`` sends its client the answers, one per message: called
    once, by :meth:`answer`, the first time the batch is answered.
    """

    client: int
    messages: list[wire.Routed]
    run: wire.RunMeta | None  # set for a run
    reply: Callable[[list], None]
    seq: int = 0  # its number among its client's batches
    arrival: int = 0
    islands: tuple = ()
    nbytes: int = 0
    queued_at: float = 0.0
    charged: float = 0.0  # the estimate the policy was charged when it went
    answered: bool = False

    def answer(self, answers: list) -> None:
        """Answers the batch with ``answers`` unless it was answered already."""
        if not self.answered:
            self.answered = True
            self.reply(answers)


@dataclasses.dataclass(eq=False)
class ClientProcess:
    """A client process of the service."""

    id: int
    name: str
    pid: int
    node: str
    token: Any
    joined: float
    alive: bool = True
    why: str = ""
    next_seq: int = 0
    pending: dict = dataclasses.field(default_factory=dict)  # seq -> batch, until its turn
    # Its batches other than runs, in arrival order (its runs queue in the service's admission).
    others: collections.deque = dataclasses.field(default_factory=collections.deque)
    plans: dict = dataclasses.field(default_factory=dict)  # host plan key -> hosts
    runs: int = 0
    in_flight: int = 0  # runs sent to the hosts and not completed
    failures: int = 0
    refused: int = 0
    device_s: float = 0.0
    by_name: dict = dataclasses.field(default_factory=dict)  # pw.client name -> device seconds
    estimates: dict = dataclasses.field(default_factory=dict)  # program -> seconds per run
    measured_once: set = dataclasses.field(default_factory=set)  # programs measured once (admission.fold)
    slices: dict = dataclasses.field(default_factory=dict)  # slice id -> device ids
    inbox: Any = None  # its own channel (a wire.Reply with no ticket): where fetched values go
    # Answers its channel could not take yet (a slow reader), oldest first, and since when.
    outbox: collections.deque = dataclasses.field(default_factory=collections.deque)
    outbox_bytes: int = 0
    stalled_since: float | None = None
    # time.monotonic() at its join: its silence counts from there until its channel is heard.
    joined_at: float = dataclasses.field(default_factory=time.monotonic)
