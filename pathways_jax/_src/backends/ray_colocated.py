"""``colocated_python`` on the Ray backend, from the controller's side: calls sent to the hosts.

A call goes to every host that owns one of its devices as ONE ``"colocated"``
message each (``ray_host.colocated``), sent under the dispatcher's lock like
a run's, so it takes its place in each host's one order of messages: after
the runs whose outputs it reads (their futures are waited for until they are
dispatched, never until they are computed), before the runs that read its
outputs (those are submitted after the call returns). Its inputs are values
already on those hosts (by key) and its outputs stay there, under keys this
side chose: :class:`~.ray_values.RemoteArray` handles, ready when the hosts
answer. Nothing of them passes through this process unless fetched.

A function is pickled (cloudpickle, Ray's copy) once per specialisation, and sent to a
host once per host and island generation: a rebuilt island's new hosts get
it again with their first call. Devices and shardings it captured pickle as
positions among the island's devices (:class:`_DevicePickler`).
"""

from __future__ import annotations

import concurrent.futures
import io
import sys
import sysconfig
import time
import types
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import jax

from pathways_jax._src.backends import ray_host
from pathways_jax._src.backends.ray_failures import message_failure
from pathways_jax._src.backends.ray_host import MessageFailed, sharding_of
from pathways_jax._src.backends.ray_host.colocated import Adopt, Call, Kept, Specs, device_at
from pathways_jax._src.backends.ray_route import DirectRoute
from pathways_jax._src.backends.ray_values import RemoteArray
from pathways_jax._src.core import errors

if TYPE_CHECKING:
    from pathways_jax._src.backends.ray_dispatch import Dispatcher

CALL_TIMEOUT_S = 120.0  # the longest a call waits for its hosts' answers when it must wait
_WAIT_STEP_S = 0.1

_runners: weakref.WeakKeyDictionary[Any, RayColocated] = weakref.WeakKeyDictionary()


def runner_of(backend: Any) -> RayColocated | None:
    """The colocated runner of a Ray backend that owns its hosts; None for any other backend."""
    if not isinstance(getattr(backend, "route", None), DirectRoute):
        return None
    runner = _runners.get(backend)
    if runner is None:
        runner = _runners[backend] = RayColocated(backend.dispatcher)
    return runner


class Sent(NamedTuple):
    """A call sent: its outputs' handles, and each host's answer (of the island's ``generation``)."""

    handles: list[RemoteArray]
    answers: dict[int, concurrent.futures.Future]
    generation: int


class Target:
    """Where a specialisation runs: its island, hosts and the stand-ins' island positions."""

    __slots__ = ("hosts", "island")

    def __init__(self, island: int, hosts: tuple[int, ...]) -> None:
        self.island = island
        self.hosts = hosts


class RayColocated:
    """Sends colocated calls to the hosts through ``dispatcher`` and makes handles of their outputs.

    A specialisation (the API's ``Specialized``) is known here by a key of
    the dispatcher's, under which its hosts keep its function; the key is
    freed on them when the specialisation goes.
    """

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        self.route = cast(DirectRoute, dispatcher.route)  # (runner_of makes runners for those only)
        self.places = dispatcher.places
        # id(specialisation) -> (its key, the pickled function, the (host, generation)s that have it)
        self._functions: dict[int, tuple[int, bytes, set[tuple[int, int]]]] = {}
        # id(specialisation) -> (its outputs, where they go: _Outputs), made at its first call with them
        self._outputs: dict[int, tuple[list, _Outputs]] = {}
        self.calls = 0
        self.fed = 0  # inputs that went from this process with a call (arrays here, not on hosts)

    # --- where ---------------------------------------------------------------------------

    def target(self, devices: tuple[Any, ...], what: str) -> Target:
        """The island and hosts of ``devices`` (this cluster's stand-in devices, of one island)."""
        places = []
        for device in devices:
            try:
                places.append(self.places.place_of(device))
            except (KeyError, AttributeError):
                raise errors.PlacementError(
                    f"{what}: device {device!r} is not a device of this cluster's Ray hosts. Give it "
                    "devices of a slice (pw.devices(...).devices) or of the arrays it takes."
                ) from None
        islands = sorted({island for island, _, _ in places})
        if len(islands) != 1:
            raise errors.PlacementError(
                f"{what}: its devices are on islands {islands}; a colocated call runs on the hosts of "
                "one island (its outputs are values of that island). Call it once per island."
            )
        return Target(islands[0], tuple(sorted({host for _, _, host in places})))

    def sharding(self, island: int, desc: Any) -> Any:
        """The stand-in sharding a host's descriptor over island ``island``'s devices names."""
        return sharding_of(desc, list(self.places.islands[island]))

    # --- calls ---------------------------------------------------------------------------

    def call(
        self,
        spec: Any,
        target: Target,
        leaves: list,
        out: list[tuple[Any, Any]] | None,
        *,
        reply: bool = False,
    ) -> Any:
        """Sends the call of ``spec`` on ``leaves`` (settled inputs: handles on the hosts, or arrays here).

        ``out``: ``(aval, sharding)`` per output leaf; returns at once, a
        :class:`Sent`. ``None``: the outputs are not known yet; waits for the hosts and
        returns ``(Specs, adopt)`` where ``adopt(out)`` makes the handles.
        ``reply``: waits and returns each host's Python result, by host.
        """
        d = self.dispatcher
        what = f"colocated_python function {spec.name!r}"
        feeds = self._feeds(target, leaves, what)
        key, code, sent = self._function(spec, target.island)
        keys = [] if out is None else [next(d._keys) for _ in out]
        stash = next(d._keys) if out is None and not reply else 0
        outputs = None if out is None else self._outputs_of(spec, target, out)
        with d.lock:
            generation = self._check(target, what)
            batch = []
            for host in target.hosts:
                first = (host, generation) not in sent
                keep = None if outputs is None else outputs.kept(host, keys)
                order = Call(key, code if first else None, keep, stash, reply)
                batch.append((host, "colocated", (order, feeds[host])))
                sent.add((host, generation))
            # Equal messages (an SPMD call's, mostly) are encoded once and broadcast to the island.
            answers = dict(zip(target.hosts, self.route.send_all(batch), strict=True))
        self.calls += 1
        if reply:
            return {host: self._answer(host, answers[host], generation, what) for host in target.hosts}
        if out is None:
            found = {host: self._answer(host, answers[host], generation, what) for host in target.hosts}
            specs = _agreed(found, what)

            def adopt(out: list[tuple[Any, Any]]) -> Sent:
                keys = [next(d._keys) for _ in out]
                outputs = _Outputs(self.places, target, out)
                with d.lock:
                    generation = self._check(target, what)
                    batch: list[tuple[int, str, tuple]] = [
                        (host, "colocated", (Adopt(stash, outputs.kept(host, keys)), []))
                        for host in target.hosts
                    ]
                    adopted = dict(zip(target.hosts, self.route.send_all(batch), strict=True))
                return Sent(self._handles(outputs, keys, out, adopted, generation), adopted, generation)

            return specs, adopt
        return Sent(
            self._handles(cast(_Outputs, outputs), keys, out, answers, generation), answers, generation
        )

    def _outputs_of(self, spec: Any, target: Target, out: list[tuple[Any, Any]]) -> _Outputs:
        """Where ``spec``'s outputs go on each host (worked out once per specialisation and outputs)."""
        known = self._outputs.get(id(spec))
        if known is None or known[0] is not out or known[1].hosts != target.hosts:
            known = self._outputs[id(spec)] = (out, _Outputs(self.places, target, out))
        return known[1]

    def _check(self, target: Target, what: str) -> int:
        """The island's generation; raises if it is lost (call with the lock held)."""
        d = self.dispatcher
        if d.closed:
            raise errors.ClusterError(f"{what}: the cluster was shut down.")
        if target.island in d.lost:
            raise errors.HostLostError(d.losses.message(target.island, what))
        return d.generations[target.island]

    def _feeds(self, target: Target, leaves: list, what: str) -> dict[int, list]:
        """Each host's inputs: the key of a value on the hosts, or an array of this process's."""
        d = self.dispatcher
        feeds: dict[int, list] = {host: [] for host in target.hosts}
        for index, value in enumerate(leaves):
            if isinstance(value, RemoteArray):
                if value.backend is not d:
                    raise errors.PlacementError(
                        f"{what}: input {index} belongs to another cluster (one shut down since); "
                        "pass its .result() instead."
                    )
                if tuple(value.hosts) != target.hosts:
                    raise errors.PlacementError(
                        f"{what}: input {index} is on hosts {list(value.hosts)}; the call runs on hosts "
                        f"{list(target.hosts)}. Give every input the devices the call runs on."
                    )
                if value.generation != d.generations[target.island]:
                    raise errors.HostLostError(d.losses.message(target.island, f"input {index} of {what}"))
                for host in target.hosts:
                    feeds[host].append((index, "value", value.key))
                continue
            placed = self.places.where(value.sharding, f"input {index} of {what}")
            data = (ray_host.to_wire(value), placed.desc)
            for host in target.hosts:
                feeds[host].append((index, "data", data))
            self.fed += 1
        return feeds

    def _function(self, spec: Any, island: int) -> tuple[int, bytes, set[tuple[int, int]]]:
        """The key, pickled function and receivers of ``spec`` (made at its first call)."""
        known = self._functions.get(id(spec))
        if known is None:
            key = next(self.dispatcher._keys)
            code = self._pickle(spec.code(), island, spec.name)
            known = self._functions[id(spec)] = (key, code, set())
            weakref.finalize(spec, self._forget, id(spec), key)
        return known

    def _forget(self, spec_id: int, key: int) -> None:
        """A specialisation went: its hosts drop its function (with their next freed values)."""
        self._outputs.pop(spec_id, None)
        entry = self._functions.pop(spec_id, None)
        if entry is None:
            return
        for host in {host for host, _ in entry[2]}:
            self.dispatcher.drop(host, key)

    def _pickle(self, code: Any, island: int, name: str) -> bytes:
        buffer = io.BytesIO()
        try:
            _DevicePickler(buffer, self.places, island, name).dump(code)
        except errors.PathwaysError:
            raise
        except Exception as exc:
            raise errors.also(errors.PathwaysError, TypeError)(
                f"colocated_python function {name!r} cannot be pickled to go to its hosts: "
                f"{type(exc).__name__}: {exc}. What it captures must pickle with cloudpickle."
            ) from exc
        return buffer.getvalue()

    def _handles(
        self,
        outputs: _Outputs,
        keys: list[int],
        out: list[tuple[Any, Any]],
        answers: dict[int, concurrent.futures.Future],
        generation: int,
    ) -> list[RemoteArray]:
        handles = []
        for key, (aval, sharding), hosts in zip(keys, out, outputs.holders, strict=True):
            dones = tuple(answers[host] for host in hosts)
            handles.append(RemoteArray(self.dispatcher, hosts, key, aval, sharding, dones, generation))
        return handles

    def failure(
        self, host: int, answer: concurrent.futures.Future, generation: int, what: str
    ) -> BaseException | None:
        """The error of a call's answer that came (None: it went well); for calls with no outputs."""
        try:
            self._answer(host, answer, generation, what)
        except errors.PathwaysError as exc:
            return exc
        return None

    def _answer(self, host: int, answer: concurrent.futures.Future, generation: int, what: str) -> Any:
        """A host's answer, waited for (at most ``CALL_TIMEOUT_S``); raises what it means."""
        d = self.dispatcher
        deadline = time.monotonic() + CALL_TIMEOUT_S
        try:
            while concurrent.futures.wait([answer], timeout=_WAIT_STEP_S).not_done:
                if d.closed:
                    raise errors.ClusterError(f"{what}: the cluster was shut down.")
                if time.monotonic() > deadline:
                    raise errors.FutureTimeoutError(
                        f"{what}: host {host} did not answer within {CALL_TIMEOUT_S:.0f}s."
                    )
            value = answer.result()
        except errors.PathwaysError:
            raise
        except Exception as exc:
            lost = d.route.loss(host, exc, generation, what)
            if lost is not None:
                raise lost from exc
            raise errors.ProgramFailedError(f"{what} failed on host {host}: {exc}") from exc
        if isinstance(value, MessageFailed):
            raise message_failure(value, host, value.message)
        return value


class _Outputs:
    """Where a call's outputs go: for each host, each output's sharding descriptor there (None: not
    there), shape and dtype; and the hosts that hold each output."""

    __slots__ = ("holders", "hosts", "per_host")

    def __init__(self, places: Any, target: Target, out: list[tuple[Any, Any]]) -> None:
        self.hosts = target.hosts
        self.per_host: dict[int, list[tuple[Any, tuple[int, ...], str]]] = {host: [] for host in target.hosts}
        self.holders: list[tuple[int, ...]] = []
        for aval, sharding in out:
            placed = places.where(sharding, "an output")
            self.holders.append(placed.hosts)
            for host in target.hosts:
                desc = placed.desc if host in placed.hosts else None
                self.per_host[host].append((desc, tuple(aval.shape), str(aval.dtype)))

    def kept(self, host: int, keys: list[int]) -> tuple[Kept, ...]:
        """What host ``host`` keeps of the outputs, under ``keys``."""
        return tuple(Kept(key, *where) for key, where in zip(keys, self.per_host[host], strict=True))


def _agreed(found: dict[int, Any], what: str) -> Specs:
    """The outputs every host found (one island: one global value each)."""
    specs = list(found.values())
    first = specs[0]
    for host, other in found.items():
        if not isinstance(other, Specs):
            raise errors.ProgramFailedError(f"{what}: host {host} answered {other!r}, not its outputs.")
        if other != first:
            raise errors.SpecializationError(
                f"{what} returned different outputs on its hosts ({first} and {other}). Each host must "
                "return the same global arrays (as a multi-controller JAX program), or specialize it "
                "with out_specs_fn."
            )
    return first


class _DevicePickler:
    """cloudpickle that writes this cluster's stand-in devices as their island positions."""

    def __init__(self, file: Any, places: Any, island: int, name: str) -> None:
        from ray import cloudpickle  # Ray's own copy: the backend has Ray, and the hosts read its pickles

        outer = self

        class Pickler(cloudpickle.Pickler):
            def reducer_override(self, obj: Any) -> Any:
                if isinstance(obj, jax.Device):
                    return outer.reduce_device(obj)
                if isinstance(obj, types.FunctionType | type):
                    outer.by_value(obj)
                return super().reducer_override(obj)

        self._pickler = Pickler(file)
        self._by_value: list[Any] = []  # modules registered to go by value during this dump
        self.places = places
        self.island = island
        self.name = name

    def reduce_device(self, device: Any) -> Any:
        try:
            island, position, _ = self.places.place_of(device)
        except (KeyError, AttributeError):
            island, position = None, -1
        if island != self.island:
            raise errors.PlacementError(
                f"colocated_python function {self.name!r} captures device {device!r}, which is not a "
                f"device of island {self.island}, where it runs. Capture devices (meshes, shardings) "
                "of the devices it runs on."
            )
        return device_at, (position,)

    def by_value(self, obj: Any) -> None:
        """Has the module of function or class ``obj`` go by value if the hosts cannot import it."""
        from ray import cloudpickle

        module = sys.modules.get(getattr(obj, "__module__", "") or "")
        if module is None or module.__name__ == "__main__" or module in self._by_value:
            return
        if not _importable_anywhere(module):
            cloudpickle.register_pickle_by_value(module)
            self._by_value.append(module)

    def dump(self, code: Any) -> None:
        """Pickles ``code``: the user's modules go by value unless the hosts can import them too."""
        from ray import cloudpickle

        try:
            self._pickler.dump(code)
        finally:
            for module in self._by_value:
                cloudpickle.unregister_pickle_by_value(module)
            self._by_value.clear()


def _importable_anywhere(module: Any) -> bool:
    """Whether a host process imports ``module`` as this one did: built in, of the standard
    library or an installed package, or ours.

    A test module or a script's helper module (found through a path this process
    added) is not: its functions and classes travel by value.
    """
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py") or module.__name__.split(".")[0] == "pathways_jax":
        return True
    return path.startswith(_INSTALLED)


_INSTALLED = tuple({sysconfig.get_paths()[name] for name in ("stdlib", "platstdlib", "purelib", "platlib")})
