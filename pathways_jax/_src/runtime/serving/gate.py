"""The controller service's admission: which client's batch goes to the hosts next.

A client's batches are taken in its own numbering. Its runs queue in the
in-process controller's admission core (``runtime/admission.py``: a queue per
client process, the policy of ``runtime/scheduler.py``); a run goes when
every island it touches has room in its window and its outputs fit the
byte budget, and fails when it never will or waited past the backpressure
timeout. Its other batches go at once, unless they name what one of its
queued runs makes or reads (a Forget also waits for its earlier queued runs
that register plans: one may run a computation the forgotten plan brought).
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pathways_jax._src.backends.ray_host import Refused
from pathways_jax._src.runtime import admission
from pathways_jax._src.runtime.scheduler import Head, Policy
from pathways_jax._src.runtime.serving.ledger import Ledger
from pathways_jax._src.runtime.serving.records import Batch, ClientProcess

if TYPE_CHECKING:  # the channels need the ray extra (pyzmq, msgspec): imported where used
    from pathways_jax._src import wire


class Gate:
    """The service's queues of runs, its windows and byte budget, and the order batches go in.

    ``clients`` and ``ledger`` are the actor's (shared); ``forward(client, batch)``
    sends a batch that may go, ``fail(client, batch, refused)`` answers one that will not.
    """

    def __init__(
        self,
        policy: Policy,
        clients: dict[int, ClientProcess],
        ledger: Ledger,
        *,
        window_size: int,
        memory_budget: int | None,
        backpressure_timeout: float | None,
        forward: Callable[[ClientProcess, Batch], None],
        fail: Callable[[ClientProcess, Batch, Refused], None],
    ) -> None:
        self.admission: admission.Queues[int, Batch] = admission.Queues(policy)
        self.clients = clients
        self.ledger = ledger
        self.window_size = window_size
        self.memory_budget = memory_budget
        # No budget (None or 0): every run fits, and the queues need not be asked so at each pump.
        self._budgeted = bool(memory_budget)
        self.backpressure_timeout = backpressure_timeout
        self.forward = forward
        self.fail = fail
        self.in_flight: collections.Counter[int] = collections.Counter()  # runs sent, by island
        self._arrival = itertools.count()

    def submit(
        self,
        client: ClientProcess,
        seq: int,
        messages: list,
        run: wire.RunMeta | None,
        reply: Callable[[list], None],
    ) -> None:
        """A client's batch number ``seq``; ``reply`` gets each message's answer once they are done."""
        batch = Batch(client.id, messages, run, reply, seq)
        if not client.alive:
            gone = Refused(f"client {client.name!r} is not connected to this service ({client.why})", "gone")
            batch.answer([gone] * len(messages))
            return
        client.pending[seq] = batch
        while client.next_seq in client.pending:
            ready = client.pending.pop(client.next_seq)
            client.next_seq += 1
            ready.arrival = next(self._arrival)
            ready.queued_at = time.monotonic()
            if ready.run is not None:
                ready.islands = tuple(ready.run.islands)
                ready.nbytes = sum(ready.run.nbytes.values())
                self.admission.push(client.id, ready)
            else:
                client.others.append(ready)
        self.pump()

    def pump(self) -> None:
        """Sends queue heads while the policy finds one that may go."""
        while True:
            # Everything but runs goes at once, ahead of the client's queued runs
            # unless it names what they read or make (a fetch of a queued run's
            # output waits for that run, a free for the runs reading the value).
            others = [
                (c, b) for c in self.clients.values() if c.others and c.alive for b in self._unblocked(c)
            ]
            if others:
                for client, batch in others:
                    client.others.remove(batch)
                    self.forward(client, batch)
                continue
            heads = self.admission.heads()
            if not heads:
                return
            clients = self.clients
            if self._budgeted and any(self._over_budget(clients[key], batch) for key, batch in heads):
                continue  # a run failed for memory: look at the queues again
            runs = [(clients[key], batch) for key, batch in heads if self._may_go(batch)]
            if not runs:
                return
            choices = [self._head(c, b) for c, b in runs]
            index = self.admission.pick(choices)
            client, batch = runs[index]
            batch.charged = choices[index].cost
            self.admission.pop(client.id)
            self.forward(client, batch)

    @staticmethod
    def _head(client: ClientProcess, batch: Batch) -> Head:
        """A queued run as the policy sees it."""
        run = batch.run
        assert run is not None  # only runs queue for the policy
        return Head(
            client.id, batch.arrival, run.priority, run.weight, client.estimates.get(run.program, 0.0)
        )

    def _unblocked(self, client: ClientProcess) -> list[Batch]:
        """The client's batches other than runs that need none of its earlier queued runs to go first."""
        from pathways_jax._src import wire

        if not client.others:
            return []
        runs = iter(self.admission.queues.get(client.id, ()))  # in arrival order
        run = next(runs, None)
        reads: set = set()
        makes: set = set()
        plans: set = set()
        # Whether an earlier queued run registers a plan: it may run a computation the client sent
        # with a plan it forgets now (sent once per host), which that Forget would drop first.
        registers = False
        ready = []
        for batch in client.others:
            while run is not None and run.arrival < batch.arrival:
                for routed in run.messages:
                    match routed.item:
                        case wire.Run(plan=plan, feeds=feeds, keep=keep):
                            plans.add(plan)
                            reads.update(feed.value for feed in feeds if feed.value is not None)
                            makes.update(local for _slot, local in keep)
                        case wire.Register():
                            registers = True
                run = next(runs, None)
            blocked = False
            for routed in batch.messages:
                match routed.item:
                    case wire.Fetch(key=key) | wire.Share(key=key):
                        blocked |= key in makes
                    case wire.Free(keys=keys):
                        blocked |= any(key in makes or key in reads for key in keys)
                    case wire.Forget(plan=plan):
                        blocked |= registers or plan in plans
            if not blocked:
                ready.append(batch)
        return ready

    def _may_go(self, batch: Batch) -> bool:
        in_flight, size = self.in_flight, self.window_size
        for island in batch.islands:
            if not admission.has_room(in_flight[island], 1, size):
                return False
        return not self._budgeted or self.ledger.fits(batch.nbytes)

    def _over_budget(self, client: ClientProcess, batch: Batch) -> bool:
        """Fails (and takes off the queue) a run that will never fit, or waited too long to; True if it did."""
        if self.ledger.fits(batch.nbytes):
            return False
        waited = time.monotonic() - batch.queued_at
        never = self.ledger.exceeds(batch.nbytes)
        if not never and not admission.waited_too_long(
            batch.queued_at, time.monotonic(), self.backpressure_timeout
        ):
            return False
        # It can never fit, or waited too long: it fails, and the queue goes on.
        self.admission.drop(client.id, Head(client.id, batch.arrival))
        why = (
            f"its outputs ({batch.nbytes} bytes) exceed the service's whole memory budget "
            f"({self.memory_budget} bytes)"
            if never
            else f"it waited {waited:.1f}s for memory under the service's budget ({self.memory_budget} bytes, "
            f"{self.ledger.held} held)"
        )
        client.failures += 1
        self.fail(client, batch, Refused(f"the run cannot be admitted: {why}", "memory"))
        return True
