"""A client process's route to the hosts: through the controller service it joined.

:class:`ServiceRoute` is the ``ray_dispatch.Route`` of a controller
service's client (``service_client.ServiceBackend``). Every message goes to
the service, in numbered batches on the service's channel (a run's messages
in one, with the run's islands, uuids and bytes for the service's
policies); the service numbers the hosts' messages and transfers and
answers for the hosts. A fetched value comes straight from its host to this
process's own channel (the inbox) where the service asks the host to send
it so. A host's death is the service's word: a health check asks it.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from pathways_jax._src.backends.host_link import HostGone
from pathways_jax._src.backends.ray_failures import is_lost_error
from pathways_jax._src.backends.ray_host import Refused, RunFailure
from pathways_jax._src.backends.ray_losses import Losses
from pathways_jax._src.core import errors

if TYPE_CHECKING:  # the channel needs the ray extra (pyzmq, msgspec): imported where used
    from pathways_jax._src import wire

_SEND_TIMEOUT_S = 10.0  # a service that takes no batch for this long is stuck (or gone)
# A value its host says it sent straight here fails if it has not come within this long.
STOPPED = "the service stopped"  # why a service that stops drops its clients (serving.actor)
DIRECT_TIMEOUT_S = 30.0


class ServiceRoute:
    """Batches to the service ``service_name`` on ``channel``; values back on this process's inbox.

    ``refresh`` asks the service which islands are lost and applies its word
    (the backend's); ``losses`` is what it applied. ``dropped_why`` says why
    the service dropped this process, once it did.
    """

    def __init__(self, service_name: str, channel: Any, losses: Losses, refresh: Callable[[], None]) -> None:
        from pathways_jax._src import wire
        from pathways_jax._src.backends import channel_link

        self.service_name = service_name
        self.losses = losses
        self.refresh = refresh
        self.dropped_why: str | None = None
        self.left = False  # this process left the service (closed its side)
        self._batches = 0
        self._owed: dict[int, list[concurrent.futures.Future]] = {}  # batch -> its answers' futures
        self._runs_owed: set[int] = set()  # those of the owed batches that carry a run
        self._owed_lock = threading.Lock()
        self._gone: str | None = None  # why the service will answer nothing more
        # Fetch batches whose value comes straight here: batch -> the host it comes from.
        self._direct: dict[int, int] = {}
        # Those the host said it sent (the service's None): when, to fail one that never came.
        self._sent_at: dict[int, float] = {}
        self.peer = channel.peer(self._answered, _SEND_TIMEOUT_S)
        # This process's own channel: the hosts send the values it fetches straight here.
        transport, ip = channel_link.listen_on()
        self.inbox_key = os.urandom(32)
        try:
            self.inbox = wire.Server(
                self.inbox_key, transport=transport, host=ip, on_message=self._fetched_here
            )
        except Exception:
            self.peer.close()
            raise

    # --- the Route ---------------------------------------------------------------------------------

    def message(self, host: int, kind: str, args: tuple) -> concurrent.futures.Future:
        return self.submit([(host, kind, args)], None)[0]

    def send_run(self, batch: list[tuple[int, str, tuple]], run: Any, remote: Any) -> list:
        """The run's messages in one batch, with what the service's policies read of the run."""
        plan = run.plan
        nbytes = {}
        for _host, kind, args in batch:
            if kind == "run":
                for slot, key in args[4]:
                    aval = remote.kept_outputs[slot].aval
                    nbytes[key] = math.prod(aval.shape) * aval.dtype.itemsize
        from pathways_jax._src import wire

        client = run.client
        meta = wire.RunMeta(
            sorted(remote.islands),
            remote.uuids,
            nbytes,
            plan.graph.name,
            getattr(client, "name", ""),
            float(getattr(client, "weight", 1.0)),
            int(getattr(client, "priority", 0)),
            int(getattr(client, "key", -1)),
        )
        return self.submit(batch, meta)

    def take_uuids(self, count: int) -> int:
        return 0  # the service numbers every run's transfers

    def fetched(self, host: int, answer: Any) -> Any:
        """The service answers a fetch with the host's answer, or says the host was lost."""
        if isinstance(answer, RunFailure) and answer.kind == "lost":
            # The error of a fetch whose host was lost, once the health check has marked its island.
            self.health_check({host})
            raise errors.HostLostError(self.losses.message(self.losses.layout.island_of(host), "a value"))
        return answer

    def loss(self, host: int, exc: BaseException, generation: int, what: str) -> BaseException | None:
        """A wait that raised ``exc``: the service is gone, or dropped this process (None: neither)."""
        if not is_lost_error(exc):
            return None
        return errors.ClusterError(f"{what} could not be read: {self.gone_message(exc)}")

    def gone_message(self, exc: BaseException) -> str:
        """Why the service answers nothing (``exc``: a wait's error), and what to do."""
        if self.left:
            return (
                f"this process left the controller service {self.service_name!r} (pw.shutdown(), or its "
                "exit), and its values there went with it. Call .result() before pw.shutdown() to keep a value."
            )
        if self.dropped_why is not None:
            return self.dropped_message(self.dropped_why)
        # The route's own HostGone (host -1) says what it knows; a Ray error names its class.
        why = exc.why if isinstance(exc, HostGone) and exc.host < 0 else f"{type(exc).__name__}: {exc}"
        return (
            f"the controller service {self.service_name!r} is gone ({why}). Call pw.shutdown(), start "
            "the service again and pw.init(...) to join it."
        )

    def dropped_message(self, why: str) -> str:
        """What a read says once the service dropped this process for ``why``, and what to do."""
        if why == STOPPED:  # nothing to join again: it said "join it again" of a service that stopped
            return (
                f"the controller service {self.service_name!r} dropped this process: {why}. Call "
                "pw.shutdown(), start the service again and pw.init(...) to join it."
            )
        return (
            f"the controller service {self.service_name!r} dropped this process: {why}. "
            "Call pw.shutdown() and pw.init(...) to join it again."
        )

    def silent_for(self, at_most: float) -> float:
        """Seconds since the service's channel was last heard (a heartbeat, an answer), at most ``at_most``."""
        from pathways_jax._src import wire

        heard = self.peer.last_heard(wire.SERVER)
        return at_most if heard is None else min(at_most, time.monotonic() - heard)

    def gone_now(self) -> str | None:
        """What :meth:`gone_message` says once the service answers nothing more; None while it serves."""
        gone = self._gone
        return None if gone is None else self.gone_message(HostGone(-1, gone))

    def health_check(self, hosts: set[int]) -> int | None:
        """The island of the first of ``hosts`` the service says is lost (asked now), or None."""
        self.refresh()
        island_of = self.losses.layout.island_of
        for host in sorted(hosts):
            if island_of(host) in self.losses.lost:
                return island_of(host)
        return None

    # --- batches and their answers -----------------------------------------------------------------

    def submit(self, batch: list, run: wire.RunMeta | None) -> list[concurrent.futures.Future]:
        """Sends a numbered batch to the service; one answer's future per message.

        Call with the dispatcher's lock held: batches are numbered in this process's order.
        """
        from pathways_jax._src import wire

        seq = self._batches
        self._batches += 1
        futures: list[concurrent.futures.Future] = [concurrent.futures.Future() for _ in batch]
        with self._owed_lock:
            if self._gone is not None:  # nothing will answer
                for future in futures:
                    future.set_exception(HostGone(-1, self._gone))
                return futures
            self._owed[seq] = futures
            if run is not None:
                self._runs_owed.add(seq)
            if len(batch) == 1 and batch[0][1] == "fetch":  # its value comes straight from the host
                self._direct[seq] = batch[0][0]
        try:
            from pathways_jax._src.backends.channel_link import encode

            routed = [
                wire.Routed(host, cast("wire.Request", encode(kind, args))) for host, kind, args in batch
            ]
            self.peer.send(wire.Submit(seq, routed, run))
        except wire.ChannelError as exc:  # this batch fails; the health monitor says if the service went
            with self._owed_lock:
                self._owed.pop(seq, None)
                self._runs_owed.discard(seq)
            for future in futures:
                if not future.done():
                    future.set_exception(HostGone(-1, f"it took no message: {exc}"))
        return futures

    def _answered(self, received: wire.Received) -> None:
        """The service's answers to a batch (the channel's receive thread)."""
        from pathways_jax._src import wire
        from pathways_jax._src.backends.channel_link import answer_value

        match received.body:
            case wire.Answered(seq, answers):
                try:
                    values = [answer_value(item) for item in answers]
                except Exception as exc:  # every message of the batch fails, saying why
                    values = [Refused(f"the service's answer did not decode: {exc}", "gone")]
                with self._owed_lock:
                    if seq in self._direct and len(values) == 1 and values[0] is None:
                        self._sent_at[seq] = time.monotonic()
                        return  # the host sent the value here: fetched_here settles it
                    futures = self._owed.pop(seq, None)
                    self._runs_owed.discard(seq)
                    self._direct.pop(seq, None)
                    self._sent_at.pop(seq, None)
                if futures is None:
                    return
                if len(values) != len(futures):  # one answer for the whole batch (a refusal)
                    values = [values[0] if values else Refused("the service answered nothing", "gone")] * len(
                        futures
                    )
                for future, value in zip(futures, values, strict=True):
                    if not future.done():
                        future.set_result(value)

    def _fetched_here(self, received: wire.Received) -> None:
        """A value a host sent straight to this process (its inbox's receive thread)."""
        from pathways_jax._src import wire
        from pathways_jax._src.backends import channel_link

        if not isinstance(received.body, wire.Fetched | wire.Failed):
            return  # hosts send this channel nothing else
        ticket = received.body.seq  # the fetch's ticket
        try:
            value: Any = channel_link.answer_value(received.body)
        except Exception as exc:
            value = Refused(f"a host's value did not decode: {type(exc).__name__}: {exc}", "gone")
        with self._owed_lock:
            if ticket not in self._direct:
                return  # answered already (a failure the service saw first)
            del self._direct[ticket]
            self._sent_at.pop(ticket, None)
            futures = self._owed.pop(ticket, None)
        if futures and not futures[0].done():
            futures[0].set_result(value)

    def fail_direct(self, hosts: set[int], why: str, *, sent_before: float | None = None) -> None:
        """Fetches whose values were to come from ``hosts`` (lost) fail: nothing will come. With
        ``sent_before``: those the host said it sent before then (a value lost on its way)."""
        with self._owed_lock:
            tickets = [
                ticket
                for ticket, host in self._direct.items()
                if host in hosts
                and (sent_before is None or self._sent_at.get(ticket, sent_before) < sent_before)
            ]
            futures: list[concurrent.futures.Future] = []
            for ticket in tickets:
                del self._direct[ticket]
                self._sent_at.pop(ticket, None)
                futures.extend(self._owed.pop(ticket, ()))
        for future in futures:
            if not future.done():
                future.set_result(RunFailure("lost", None, why, ""))

    def fail_late(self) -> None:
        """Fetches whose host said it sent the value ``DIRECT_TIMEOUT_S`` ago and that never came fail."""
        if self._sent_at:
            self.fail_direct(
                set(range(self.losses.layout.hosts)),
                f"a fetched value its host sent did not arrive within {DIRECT_TIMEOUT_S:.0f}s",
                sent_before=time.monotonic() - DIRECT_TIMEOUT_S,
            )

    def fail_owed(self, why: str) -> None:
        """Every answer still owed fails, and every later one: the service is gone (or this side closed)."""
        with self._owed_lock:
            self._gone = why
            owed = [f for futures in self._owed.values() for f in futures]
            self._owed.clear()
            self._runs_owed.clear()
            self._direct.clear()
            self._sent_at.clear()
        for future in owed:
            if not future.done():
                future.set_exception(HostGone(-1, why))

    def dropped(self, why: str) -> None:
        """The service dropped this process: it answers nothing more, and reads say why."""
        self.dropped_why = why
        self.fail_owed(f"it dropped this process: {why}")

    def close(self) -> int:
        """Fails what is still owed (this process left) and closes both channels. Returns how many
        runs it failed: sent, their answers still to come (a run answered before has its values)."""
        self.left = True
        with self._owed_lock:
            runs = 0 if self._gone is not None else len(self._runs_owed)
        self.fail_owed("this process left it")
        self.peer.close()
        self.inbox.close()
        return runs
