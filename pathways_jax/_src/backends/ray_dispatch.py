"""Runs and values on hosts, from the controller's side: plans split, runs sent, values fetched.

What the Ray backend and a controller service's client do alike lives in
one :class:`Dispatcher` that each holds: it splits a lowered plan per host,
sends each host of a run its one message, retires the runs the hosts have
answered, frees on the hosts the values whose handles went, brings values
here and says what a host's answer means. It is the holder of every value
it made (``ray_values.Holder``).

What differs between the two is the :class:`Route` it is given: how its
messages reach the hosts, and what a failure to hear from one means. The
Ray backend's (``ray_route.DirectRoute``) numbers each host's messages and
sends them over its own link to its host actors; a client's
(``service_route.ServiceRoute``) sends each run to the controller service as
one batch, and the service answers for the hosts.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import jax
import numpy as np
from absl import logging

from pathways_jax._src.backends import ray_host
from pathways_jax._src.backends.base import Dispatched, Prepared, StepFailed, Windows
from pathways_jax._src.backends.ray_failures import message_failure, refusal, with_remote_traceback
from pathways_jax._src.backends.ray_host import KeyData, Refused, RunDone, RunFailure, Shards
from pathways_jax._src.backends.ray_losses import Losses
from pathways_jax._src.backends.ray_places import Places
from pathways_jax._src.backends.ray_plan import RemotePlan
from pathways_jax._src.backends.ray_send import Sender
from pathways_jax._src.backends.ray_values import RemoteArray
from pathways_jax._src.core import counts, errors, events

if TYPE_CHECKING:
    from pathways_jax._src.compile.lowering import Plan

_FLUSH_S = 0.05  # how often freed values are sent back to their hosts
CALL_TIMEOUT_S = 120.0
_WAIT_STEP_S = 0.1  # a wait for a host's answer looks whether the cluster closed this often
_CLOSED = (
    "the cluster was shut down and its Ray hosts with it; values that lived on them are gone. "
    "Call .result() before pw.shutdown() to keep a value."
)


class Route(Protocol):
    """How a :class:`Dispatcher`'s messages reach the hosts, and what a failure to hear from one means.

    The sending methods are called with the dispatcher's ``lock`` held, so
    that every host sees its messages in one order.
    """

    def message(self, host: int, kind: str, args: tuple) -> concurrent.futures.Future:
        """Sends host ``host`` one message; the future of its answer."""
        ...

    def send_run(self, batch: list[tuple[int, str, tuple]], run: Any, remote: RemotePlan) -> list:
        """Sends a run's messages ``(host, kind, args)`` (each host's in order); their answers' futures."""
        ...

    def take_uuids(self, count: int) -> int:
        """The first of ``count`` fresh transfer uuids for a run (0: whoever sends it numbers them)."""
        ...

    def fetched(self, host: int, answer: Any) -> Any:
        """A host's answer to a fetch, as the host gave it; raises if it says the host was lost."""
        ...

    def loss(self, host: int, exc: BaseException, generation: int, what: str) -> BaseException | None:
        """The error of ``what`` (a run, a value) whose wait on ``host`` raised ``exc``; None: not a loss."""
        ...

    def health_check(self, hosts: set[int]) -> int | None:
        """The island of the first of ``hosts`` found dead (marked lost), or None if none is known dead."""
        ...


class Collects(Protocol):
    """What the flush loop reads of the backend that runs it: the store's collect, set by the cluster."""

    collect: Callable[[], None] | None


def _assemble(results: list) -> Any:
    """One numpy array from the hosts' answers: one host's whole array, or every host's shards."""
    for result in results:
        if isinstance(result, np.ndarray):  # a host holding all of it
            return result
    parts = [part for result in results for part in result.parts]
    # The raw data of typed keys has trailing dimensions the keys' shape does not: read them off.
    shape = tuple(
        max(stop for (_, stop) in dims) for dims in zip(*(bounds for bounds, _ in parts), strict=True)
    )
    whole = np.empty(shape, dtype=parts[0][1].dtype)
    for bounds, data in parts:
        whole[tuple(slice(start, stop) for start, stop in bounds)] = data
    return whole


def _succeeded(status: Any) -> bool:
    """Whether a host's answer to a run says it was done (in how much device time)."""
    return status is None or isinstance(status, float | RunDone)


class Dispatcher:
    """Runs and values on ``places``' hosts, sent and heard through ``route``.

    Attributes:
      places: where the stand-in devices are on the hosts.
      losses: the lost islands and each island's generation (changed with ``lock`` held).
      sender: what each host has and is to free (and, on the Ray backend, each host's numbering).
      route: how messages reach the hosts.
      lock: held while messages are numbered and sent, and while losses change.
      closed: set when the backend closes: nothing waits on a host after that.
      closed_message: what a value read after the close raises ``ClusterError`` with.
    """

    def __init__(
        self, ray: Any, places: Places, losses: Losses, sender: Sender, route: Route, closed: str = _CLOSED
    ) -> None:
        self.ray = ray
        self.places = places
        self.layout = places.layout
        self.losses = losses
        # Read by every value's readiness and fetch (ray_values.Holder): the losses' own.
        self.lost = losses.lost
        self.generations = losses.generations
        self.sender = sender
        self.route = route
        self.lock = threading.Lock()
        self.closed = False
        self.closed_message = closed  # what a value read after the close says
        self._keys = itertools.count()

    def prepare(self, plan: Plan) -> Prepared:
        """Splits ``plan`` into one part per host; a run then makes one message (and report) per host."""
        remote = RemotePlan(self.places, plan)
        for island in remote.islands:
            if island in self.lost:
                raise errors.HostLostError(self.losses.message(island, f"program {plan.graph.name!r}"))
        # The hosts keep their parts as long as the prepared plan holds this one.
        weakref.finalize(remote, self.sender.forget, remote.key, remote.hosts)
        return Prepared(dict(remote.windowed), remote.islands, len(remote.hosts), remote)

    def execute(self, run: Any, windows: Windows) -> Dispatched:
        """Sends each host of ``run`` its one message; the hosts do the rest."""
        plan = run.plan
        remote: RemotePlan | None = plan.prepared.part
        if remote is None:
            # A plan that places nothing (it returns literals or its arguments)
            # was prepared by no backend: no host takes part, its values are here.
            return Dispatched(run.env)
        for island in plan.prepared.windowed:
            windows.make_room(island)
        sink = events.SINK
        t0 = events.now() if sink is not None else 0
        try:
            outputs, markers = self.dispatch(run)
        except Exception as exc:
            raise StepFailed(
                f"program {plan.graph.name!r} run {run.id} could not be sent to its hosts", exc
            ) from exc
        counts.bump("dispatches", len(markers))
        for kind, count in remote.transfers.items():
            counts.bump(f"transfers_{kind}", count)
        if remote.pulls:
            counts.bump("host_pulls", remote.pulls)
        island_of = self.layout.island_of
        for host, marker in markers.items():
            windows.in_flight(island_of(host), marker, run)
            if sink is not None:
                ids = tuple(d.id for d in self.places.host_devices(host))
                name, island = plan.graph.name, island_of(host)
                sink(
                    events.Sent(run.id, run.client.name, name, host, island, ids, t0, events.now(), (marker,))
                )
        slot_hosts = remote.slot_hosts
        copies = (
            {position: outputs[slot] for position, slot in remote.copies.items()} if remote.copies else None
        )
        return Dispatched(
            outputs, tuple([markers[slot_hosts[group.slot][0]] for group in plan.acct_groups]), copies
        )

    def _send_forgets(self) -> None:
        """Tells hosts to forget the plans that went; call with ``lock`` held."""
        for host, key in self.sender.take_forgotten(self.losses.lost_hosts):
            self.route.message(host, "forget", (key,))

    def dispatch(self, run: Any) -> tuple[dict[int, RemoteArray], dict[int, RemoteArray]]:
        """Sends each host of ``run`` its one message; returns output handles and one marker per host."""
        plan = run.plan
        remote: RemotePlan = plan.prepared.part
        env = run.env
        markers: dict[int, RemoteArray] = {}
        keys = {slot: next(self._keys) for part in remote.parts.values() for slot in part.keep}
        name = plan.graph.name
        with self.lock:
            for island in remote.islands:
                if island in self.lost:
                    raise errors.HostLostError(self.losses.message(island, f"program {name!r}"))
            generations = {island: self.generations[island] for island in remote.islands}
            # Every host's inputs first: a run that fails here sends nothing, so no
            # host waits for a value from a host that never got its part.
            messages: dict[int, tuple[list, list]] = {}
            for host in remote.hosts:
                hp = remote.parts[host]
                feeds: list[tuple] = []
                for slot in hp.futures:
                    value = env[slot]
                    if isinstance(value, jax.Array):  # here, not on the hosts: it goes with the message
                        desc = remote.future_descs[slot]
                        feeds.append(
                            (slot, "data", (self.places.fed(ray_host.to_wire(value), desc, host), desc))
                        )
                        continue
                    if not isinstance(value, RemoteArray) or value.backend is not self:
                        raise errors.PlacementError(
                            f"program {name!r}: an input future belongs to another cluster "
                            "(one shut down since); pass its .result() instead"
                        )
                    if value.hosts != remote.slot_hosts[slot]:
                        raise errors.PlacementError(
                            f"program {name!r}: an input future is on hosts {list(value.hosts)}, "
                            f"not on hosts {list(remote.slot_hosts[slot])}, where the program reads it"
                        )
                    island = self.layout.island_of(host)
                    if value.generation != generations[island]:
                        raise errors.HostLostError(
                            self.losses.message(island, f"an input of program {name!r}")
                        )
                    feeds.append((slot, "value", value.key))
                for source, slot, desc in hp.data:  # each host its own blocks of a value over several
                    feeds.append(
                        (slot, "data", (self.places.fed(ray_host.to_wire(env[source]), desc, host), desc))
                    )
                messages[host] = (feeds, [(slot, keys[slot]) for slot in hp.keep])
            base = self.route.take_uuids(remote.uuids)
            # The run's messages, every host's at once: the hosts of an island must
            # all see them at the same place in their order.
            batch: list[tuple[int, str, tuple]] = []
            runs: dict[int, int] = {}  # host -> index of its run message in the batch
            sender = self.sender
            for host, (feeds, keep) in messages.items():
                hp = remote.parts[host]
                if remote.key not in sender.known[host]:
                    have = sender.fingerprints[host]
                    blobs = {f: b for f, b in hp.blobs.items() if f not in have}
                    batch.append((host, "register", (remote.key, hp.ops, hp.constants, blobs, remote.x64)))
                    have.update(blobs)
                    sender.registered(host, remote.key, frozenset(hp.blobs))
                frees = sender.take_dropped(host)
                runs[host] = len(batch)
                batch.append((host, "run", (remote.key, run.id, base, feeds, keep, frees)))
            answers = self.route.send_run(batch, run, remote)
            for host, index in runs.items():
                generation = generations[self.layout.island_of(host)]
                markers[host] = RemoteArray(self, (host,), None, None, None, (answers[index],), generation)
        outputs: dict[int, RemoteArray] = {}
        for slot, key in keys.items():
            out = remote.kept_outputs[slot]
            hosts = remote.slot_hosts[slot]
            dones = tuple(markers[h].dones[0] for h in hosts)
            generation = markers[hosts[0]].generation
            outputs[slot] = RemoteArray(self, hosts, key, out.aval, out.sharding, dones, generation)
        return outputs, markers

    def fresh_keys(self, count: int) -> list[int]:
        """``count`` value keys no host uses yet (for values made by messages other than runs)."""
        return [next(self._keys) for _ in range(count)]

    def settle(self, in_flight: collections.deque) -> None:
        """Drops the completed head of an island's in-flight deque.

        Each host answers its runs in order, so the deque completes from the
        front: the head is looked at, then each next entry while they are
        done (not every entry each time).
        """
        while in_flight:
            marker = in_flight[0][0]
            if not marker._ready:
                if not marker.dones[0].done():
                    return
                marker._ready = True
            in_flight.popleft()

    def drop(self, host: int, key: int | tuple[int, int]) -> None:
        """A handle went: its value is freed on its host with the next message there."""
        self.sender.dropped[host].append(key)

    def flush_loop(self, owner: Collects) -> None:
        """Frees on the hosts what went here, every ``_FLUSH_S``, until closed (a thread of ``owner``'s)."""
        lost_hosts = self.losses.lost_hosts
        while not self.closed:
            time.sleep(_FLUSH_S)
            try:
                if owner.collect is not None:
                    owner.collect()
                sender = self.sender
                if not any(sender.dropped) and not sender.forgotten:
                    continue
                with self.lock:
                    if not self.closed:
                        self._send_forgets()
                    for host in range(self.layout.hosts):
                        if sender.dropped[host] and host not in lost_hosts and not self.closed:
                            self.route.message(host, "free", (sender.take_dropped(host),))
            except Exception as exc:  # Ray itself went away (process exit): stop
                if self.closed or not self.ray.is_initialized():
                    return
                logging.warning("pathways_jax: freeing values on the Ray hosts failed once: %s", exc)

    def fetch(
        self,
        hosts: tuple[int, ...],
        key: int | tuple[int, int],
        generation: int,
        deadline: float | None = None,
    ) -> Any:
        """A kept value as a numpy array: from its host, or pieced together from its hosts' shards."""
        return self.fetched_value(hosts, self.fetch_sent(hosts, key, generation), generation, deadline)

    def fetch_sent(
        self, hosts: tuple[int, ...], key: int | tuple[int, int], generation: int
    ) -> list[concurrent.futures.Future]:
        """Asks ``hosts`` for their parts of value ``key``: the futures of their answers."""
        if self.closed:
            raise errors.ClusterError(self.closed_message)
        island = self.layout.island_of(hosts[0])
        with self.lock:
            if island in self.lost or generation != self.generations[island]:
                raise errors.HostLostError(self.losses.message(island, "a value"))
            return [self.route.message(host, "fetch", (key,)) for host in hosts]

    def fetched_value(
        self, hosts: tuple[int, ...], answers: list, generation: int, deadline: float | None = None
    ) -> Any:
        """The value ``answers`` (of :meth:`fetch_sent`) bring, as :meth:`fetch` gives it.

        Raises ``FutureTimeoutError`` if they have not all come by ``deadline`` (``time.monotonic()``;
        None: no deadline): the answers still come, and a later call with them reads the value.
        """
        if deadline is not None:
            _, pending = concurrent.futures.wait(answers, timeout=max(0.0, deadline - time.monotonic()))
            if pending:
                raise errors.FutureTimeoutError(
                    f"the value had not come from its hosts ({len(pending)} of {len(answers)} parts owed) by the "
                    "deadline; it is still on its way: read it again for it"
                )
        results: list[Any] = []
        for host, answer in zip(hosts, answers, strict=True):
            try:
                result = self.route.fetched(host, answer.result(timeout=CALL_TIMEOUT_S))
            except Exception as exc:
                if self.closed:  # the hosts went with the close, not lost: a read at exit said "it died"
                    raise errors.ClusterError(self.closed_message) from exc
                lost = self.route.loss(host, exc, generation, "a value")
                if lost is not None:
                    raise lost from exc
                raise
            if isinstance(result, Refused):
                raise refusal(result)
            if not isinstance(result, np.ndarray | Shards | KeyData):
                raise with_remote_traceback(
                    errors.ProgramFailedError(f"fetching a value from host {host} failed: {result.message}"),
                    host,
                    getattr(result, "trace", ""),
                )
            results.append(result)
        keys = [result for result in results if isinstance(result, KeyData)]
        if not keys:
            return _assemble(results)
        # Typed keys: their raw data came, pieced together, then wrapped again.
        return jax.random.wrap_key_data(_assemble([k.data for k in keys]), impl=keys[0].impl)

    def outcome(self, host: int, done: Any, generation: int) -> BaseException | None:
        """None if a host's part of a run completed, else the error its values raise.

        ``generation``: of the host's island when the run was sent (a host that
        died then may have been replaced since).
        """
        if self.closed:  # a run its hosts said was done before the close still was
            if done.done() and done.exception() is None and _succeeded(done.result()):
                return None
            return errors.ClusterError(self.closed_message)
        island = self.layout.island_of(host)
        try:
            # In steps, so that a wait on a hung host ends when the cluster closes.
            while concurrent.futures.wait([done], timeout=_WAIT_STEP_S).not_done:
                if self.closed:
                    return errors.ClusterError(self.closed_message)
            status = done.result()
        except Exception as exc:
            lost = self.route.loss(host, exc, generation, "a run")
            if lost is not None:
                return lost
            return errors.ProgramFailedError(f"host {host} failed: {exc}")
        if _succeeded(status):
            return None
        if isinstance(status, Refused):  # the controller service refused the run: it touched nothing
            return refusal(status)
        if not isinstance(status, RunFailure):  # a message that failed before its run began
            return message_failure(status, host, f"host {host} failed: {getattr(status, 'message', status)}")
        if status.kind == "lost" and status.peer is not None:
            return errors.HostLostError(
                self.losses.message(self.layout.island_of(status.peer), f"a run on host {host}")
            )
        # A collective whose peer died, or a pull from a dead host, fails like a
        # program of the user's: ask the hosts it depended on whether they live.
        suspects = {h for h in self.layout.members(island) if h != host} | set(status.peers)
        gone = self.route.health_check(suspects)
        if gone is not None:
            return errors.HostLostError(self.losses.message(gone, f"a run on host {host}"))
        # An error of the host's JAX comes as its class (a JaxRuntimeError: out of memory...), as from
        # jax.jit: the future raises a ProgramFailedError that is also one.
        failure: BaseException = (
            jax.errors.JaxRuntimeError(status.message)
            if status.error == "JaxRuntimeError"
            else errors.ProgramFailedError(status.message)
        )
        return with_remote_traceback(failure, host, status.trace)
