"""Colocated Python on a host: the user's functions and objects, run in the host's one order.

The controller sends a host a ``"colocated"`` message (``Host._colocated``):
an :class:`Call` or an :class:`Adopt`, and the call's inputs (kept values
by key, or data). A function travels pickled (cloudpickle) the first time a
host gets it, and is kept under its key until the controller frees that key;
so is an object of a ``colocated_python_class``, made on the host at its
first method call. The function runs on the host's executor thread, so it
takes its place among the host's runs: after the runs whose outputs it
reads, before those that read its outputs. Its outputs are kept as values
under the keys the controller chose; they never leave the host unless
fetched.

Devices and shardings the function captured were the controller's stand-in
devices: they pickle as their position among the island's devices and come
back as this host's own devices (:func:`device_at`), so a captured mesh or
sharding names the same devices here as there.

Nothing here imports the rest of pathways_jax; JAX and cloudpickle are
imported where used.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

from pathways_jax._src.backends.ray_host.answers import MessageFailed, RunDone, trace_of
from pathways_jax._src.backends.ray_host.checkpoint import Pending
from pathways_jax._src.backends.ray_host.ops import NamedDesc, ShardingDesc, SingleDesc, sharding_of
from pathways_jax._src.backends.ray_host.values import from_wire, is_small, place, readable


class Method(NamedTuple):
    """A method of a ``colocated_python_class`` instance: the object is kept under ``instance``.

    The object is made from ``cls(*args, **kwargs)`` at its first call on a host.
    """

    cls: Any
    args: tuple
    kwargs: dict
    instance: int
    name: str


class Code(NamedTuple):
    """What a host keeps of a function: the callable (or a :class:`Method`), its name, its input tree."""

    fn: Any
    name: str
    in_tree: Any  # the jax PyTreeDef of ``(args, kwargs)``


class Kept(NamedTuple):
    """Where an output goes on this host: under ``key``, with sharding ``desc`` (None: not kept here)."""

    key: int
    desc: ShardingDesc | None
    shape: tuple[int, ...]
    dtype: str


class Call(NamedTuple):
    """Run function ``function`` (its ``code`` pickled, the first time this host gets it).

    ``keep``: where each output leaf goes. ``None`` asks what the outputs are
    (the first call of a function specialised without ``out_specs_fn``): they
    wait under ``stash`` for an :class:`Adopt`, and the answer is their
    :class:`Specs`. ``reply``: the function's Python result is the answer (for
    small values only: an input iterator's state).
    """

    function: int
    code: bytes | None
    keep: tuple[Kept, ...] | None
    stash: int = 0
    reply: bool = False


class Adopt(NamedTuple):
    """Keep the outputs waiting under ``stash`` under the keys of ``keep``."""

    stash: int
    keep: tuple[Kept, ...]


class Specs(NamedTuple):
    """A function's outputs as a host found them: their tree and ``(shape, dtype, desc)`` per leaf."""

    out_tree: Any
    leaves: tuple[tuple[tuple[int, ...], str, ShardingDesc], ...]


class ColocatedFailed(Exception):
    """The user's function raised (the host's answer carries it as a ``MessageFailed``)."""


_unpickling = threading.local()  # .devices: the island's devices while a function is unpickled


def device_at(position: int) -> Any:
    """Island device ``position`` of the host that unpickles (what a captured stand-in device becomes)."""
    devices = getattr(_unpickling, "devices", None)
    if devices is None:
        raise RuntimeError("a pathways_jax device unpickled outside a host's colocated function")
    return devices[position]


class Colocated:
    """A host's colocated functions and objects, by key, and outputs waiting to be adopted."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.functions: dict[int, Code] = {}
        self.objects: dict[int, Any] = {}
        self.stashed: dict[int, list] = {}
        self.calls = 0
        self._shardings: dict[Any, tuple[list, Any]] = {}  # descriptor -> (the devices, its sharding)

    def stats(self) -> dict:
        """Calls run here, and functions and objects kept."""
        return {"calls": self.calls, "functions": len(self.functions), "objects": len(self.objects)}

    def free(self, key: Any) -> None:
        """A key the controller freed: a function or object kept under it goes."""
        self.functions.pop(key, None)
        self.objects.pop(key, None)
        self.stashed.pop(key, None)

    def handle(self, order: Call | Adopt, feeds: list, values: dict, devices: list) -> Any:
        """The message's answer: None, ``RunDone`` (small outputs ride along), ``Specs``, a reply,
        or ``MessageFailed`` naming the function when it raised or returned what was not asked for."""
        try:
            return self._handle(order, feeds, values, devices)
        except ColocatedFailed as exc:
            return MessageFailed(str(exc), trace_of(exc))

    def _handle(self, order: Call | Adopt, feeds: list, values: dict, devices: list) -> Any:
        if isinstance(order, Adopt):
            leaves = self.stashed.pop(order.stash)
            return self._keep(leaves, order.keep, values, devices, "the function")
        code = self._code(order, devices)
        self.calls += 1
        leaves = []
        for _slot, kind, payload in feeds:
            if kind == "value":
                if payload not in values:
                    raise KeyError(
                        f"input value {payload} of colocated_python function {code.name!r} is not on "
                        f"host {self.index} (freed, or its run failed)"
                    )
                value = values[payload]
                leaves.append(
                    value.value() if isinstance(value, Pending) else value
                )  # a restore's, once read
            else:
                data, desc = payload
                leaves.append(place(from_wire(data), sharding_of(desc, devices)))
        try:
            result = self._run(code, leaves)
        except Exception as exc:
            return MessageFailed(
                f"host {self.index}: colocated_python function {code.name!r} raised "
                f"{type(exc).__name__}: {exc}",
                trace_of(exc),
                ended=isinstance(exc, StopIteration),
            )
        if order.reply:
            return result
        import jax

        out, out_tree = jax.tree_util.tree_flatten(result)
        if order.keep is None:
            specs = Specs(out_tree, tuple(_spec_of(leaf, devices, code.name) for leaf in out))
            self.stashed[order.stash] = out
            return specs
        return self._keep(out, order.keep, values, devices, f"colocated_python function {code.name!r}")

    def _code(self, call: Call, devices: list) -> Code:
        code = self.functions.get(call.function)
        if code is None:
            if call.code is None:
                raise KeyError(
                    f"colocated_python function {call.function} was never sent to host {self.index}"
                )
            import pickle  # (a cloudpickle's pickle names what it needs to load itself)

            _unpickling.devices = devices
            try:
                code = pickle.loads(call.code)
            finally:
                _unpickling.devices = None
            self.functions[call.function] = code
        return code

    def _run(self, code: Code, leaves: list) -> Any:
        import jax

        args, kwargs = jax.tree_util.tree_unflatten(code.in_tree, leaves)
        fn = code.fn
        if isinstance(fn, Method):
            obj = self.objects.get(fn.instance)
            if obj is None:  # its first call here: made now (a rebuilt host makes it again)
                obj = self.objects[fn.instance] = fn.cls(*fn.args, **fn.kwargs)
            return getattr(obj, fn.name)(*args, **kwargs)
        return fn(*args, **kwargs)

    def _sharding(self, desc: ShardingDesc, devices: list) -> Any:
        """The sharding ``desc`` names over ``devices`` (made once: every call of a function keeps its
        outputs with the same shardings)."""
        known = self._shardings.get(desc)
        if known is None or known[0] is not devices:  # (a host's island devices are set once)
            known = self._shardings[desc] = (devices, sharding_of(desc, devices))
        return known[1]

    def _keep(self, out: list, keep: tuple[Kept, ...], values: dict, devices: list, what: str) -> Any:
        import jax
        import numpy as np

        if len(out) != len(keep):
            raise ColocatedFailed(
                f"host {self.index}: {what} returned {len(out)} arrays; its out_specs name {len(keep)}. "
                "Return what out_specs_fn says, or specialize without out_specs_fn."
            )
        small = {}
        for index, (leaf, kept) in enumerate(zip(out, keep, strict=True)):
            shape, dtype = tuple(getattr(leaf, "shape", ())), str(getattr(leaf, "dtype", type(leaf).__name__))
            if shape != tuple(kept.shape) or dtype != kept.dtype:
                raise ColocatedFailed(
                    f"host {self.index}: output {index} of {what} is {dtype}{list(shape)}; its out_specs "
                    f"say {kept.dtype}{list(kept.shape)}. Return arrays as out_specs_fn describes them."
                )
            if kept.desc is None:
                continue
            sharding = self._sharding(kept.desc, devices)
            if not isinstance(leaf, jax.Array | np.ndarray):
                leaf = np.asarray(leaf)
            value = place(leaf, sharding)
            values[kept.key] = value
            if is_small(value):
                small[kept.key] = value
        if not small:
            return None
        try:
            return RunDone(0.0, {key: readable(value, np) for key, value in small.items()})
        except Exception:  # read later, by a fetch, if it cannot be read now
            return None


def _spec_of(leaf: Any, devices: list, name: str) -> tuple[tuple[int, ...], str, ShardingDesc]:
    """An output's shape, dtype and sharding over the island's devices (discovering a function's outputs)."""
    import jax

    if not isinstance(leaf, jax.Array):
        raise ColocatedFailed(
            f"colocated_python only supports jax.Array as input and output, but got {type(leaf)} "
            f"(an output of {name!r})."
        )
    return tuple(leaf.shape), str(leaf.dtype), desc_of(leaf.sharding, devices)


def desc_of(sharding: Any, devices: list) -> ShardingDesc:
    """The descriptor of a host's ``sharding`` over its island's ``devices`` (``ops.sharding_of`` inverted)."""
    import jax

    position = {device: index for index, device in enumerate(devices)}
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (device,) = sharding.device_set
        return SingleDesc(position[device])
    if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(sharding.mesh, jax.sharding.Mesh):
        mesh = sharding.mesh
        return NamedDesc(
            tuple(position[d] for d in mesh.devices.flat), mesh.devices.shape, mesh.axis_names, sharding.spec
        )
    raise ColocatedFailed(
        f"an output has sharding {sharding!r}; colocated outputs take a NamedSharding or a "
        "SingleDeviceSharding. Give it one (jax.device_put), or specialize with out_specs_fn."
    )
