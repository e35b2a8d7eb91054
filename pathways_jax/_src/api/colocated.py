"""``pw.colocated_python``: Python run on the hosts that own given devices, as JAX's own API has it.

The same names, arguments, specialisation rules and error messages as
``jax.experimental.colocated_python`` (code written for it moves by changing
its import):

- :func:`colocated_cpu_devices`: the CPU devices beside given devices. This
  cluster's devices are CPU devices (on the Ray backend, the hosts' CPU
  devices, seen here through their stand-ins): they come back as they are.
- :func:`colocated_python` wraps a function; ``.specialize(in_specs=...,
  out_specs_fn=..., devices=...)`` fixes what it takes, returns and where it
  runs, each at most once. A call with arrays finds its devices from them
  (one device list for all); a call with none needs ``devices``. Without
  ``out_specs_fn`` the first call of a specialisation waits to learn the
  outputs; every later call returns at once.
- :func:`colocated_python_class` (``colocated_class.py``) wraps a class whose
  instances live on the hosts.

**Where it runs.** On the Ray backend the function runs for real on the
host actors that own the devices, on their CPU, on each host's executor
thread in its one order of messages (``backends/ray_colocated.py``,
``backends/ray_host/colocated.py``): after the runs whose outputs it reads,
before the runs that read its outputs. Its inputs are futures of values on
those hosts (or arrays of this process, sent with the call) and its outputs
are ``pw.Future`` s of values kept on the hosts, which ``pw.program`` and
``pw.jit`` take as inputs without a hop through this process. On every host
the function sees the island's devices as a multi-controller JAX program
does (``jax.process_index()``, global arrays spanning the island's hosts),
and devices or shardings it captured name that host's own devices. On the
local backend it runs here, synchronously, as JAX runs it on plain PJRT,
and returns ``jax.Array`` s.

**Errors.** A function that raises fails its outputs' futures with
``ProgramFailedError`` carrying the host's traceback (a note on the chain);
a host lost meanwhile fails them with ``HostLostError``. A call with no
outputs raises its failure at the next call of the same function (or
object). Waits are bounded (``ray_colocated.CALL_TIMEOUT_S``).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from pathways_jax._src.backends import ray_colocated
from pathways_jax._src.backends.ray_host.colocated import Code, Method
from pathways_jax._src.core import errors
from pathways_jax._src.runtime import clients, clusters, futures
from pathways_jax._src.runtime.futures import Future
from pathways_jax._src.runtime.object_store import Owner

_SETTLE_TIMEOUT_S = 120.0  # the longest a call waits for an input's run to be dispatched
_outputs = itertools.count()
# Objects of colocated_python_class instances on the local backend, by instance key.
_local_objects: dict[int, Any] = {}


def colocated_cpu_devices(devices_or_mesh: Any) -> Any:
    """The CPU devices colocated with ``devices_or_mesh`` (a sequence of devices, or a ``Mesh``).

    A CPU device is its own colocated CPU device: this cluster's devices come
    back as they are, in order (a mesh as the same mesh). Other devices are
    looked up as JAX does.

    Example:
      >>> import pathways_jax as pw
      >>> s = pw.devices(mesh={"x": 2})
      >>> pw.colocated_python.colocated_cpu_devices(s.devices) == s.devices
      True
      >>> s.release()
    """
    if isinstance(devices_or_mesh, jax.sharding.Mesh):
        if all(d.platform == "cpu" for d in devices_or_mesh.devices.flat):
            return devices_or_mesh
    else:
        devices = tuple(devices_or_mesh)
        if all(d.platform == "cpu" for d in devices):
            return devices
    from jax.experimental import colocated_python as jax_colocated

    return jax_colocated.colocated_cpu_devices(devices_or_mesh)


@dataclasses.dataclass(frozen=True, slots=True)
class Specialization:
    """What a colocated function was specialised with (each at most once), as JAX's."""

    in_tree: Any = None
    in_specs: tuple[Any, ...] | None = None
    out_specs_fn: Callable[..., Any] | None = None
    devices: tuple[Any, ...] | None = None

    def update(
        self,
        *,
        in_specs: Any = None,
        out_specs_fn: Callable[..., Any] | None = None,
        devices: Any = None,
    ) -> Specialization:
        """A copy with more fixed; raises as JAX does for what is fixed already."""
        in_tree, in_leaves = self.in_tree, self.in_specs
        if in_specs is not None:
            if self.in_specs is not None:
                raise errors.SpecializationError("in_specs already specified")
            leaves, in_tree = jax.tree_util.tree_flatten(in_specs)
            in_leaves = tuple(leaves)
        if out_specs_fn is not None and self.out_specs_fn is not None:
            raise errors.SpecializationError("out_specs_fn already specified")
        if devices is not None and self.devices is not None:
            raise errors.SpecializationError("devices already specified")
        return Specialization(
            in_tree,
            in_leaves,
            out_specs_fn or self.out_specs_fn,
            self.devices if devices is None else _device_list(devices),
        )


class Specialized:
    """One concrete specialisation: inputs, devices, and outputs (known, or found at its first call).

    Held by its function's cache; the hosts keep its pickled function until it goes.
    """

    __slots__ = (
        "__weakref__",
        "devices",
        "fn",
        "in_specs",
        "in_tree",
        "lock",
        "name",
        "out",
        "out_specs",
        "out_tree",
    )

    def __init__(self, fn: Any, name: str, in_tree: Any, in_specs: tuple, devices: tuple) -> None:
        self.fn = fn
        self.name = name
        self.in_tree = in_tree
        self.in_specs = in_specs
        self.devices = devices
        self.out_tree: Any = None
        self.out_specs: tuple[jax.ShapeDtypeStruct, ...] | None = None
        self.out: list[tuple[Any, Any]] | None = None  # (aval, sharding) per output, once known
        self.lock = threading.Lock()  # held while the first call finds the outputs

    def code(self) -> Code:
        """What its hosts keep: the function and its input tree."""
        return Code(self.fn, self.name, self.in_tree)


class ColocatedFunction:
    """A function wrapped by :func:`colocated_python`: call it, or ``specialize`` it further."""

    def __init__(
        self, fn: Any, name: str, specialization: Specialization, owner: _Owner, wrapped: Any = None
    ) -> None:
        self._fn = fn
        self._name = name
        self._specialization = specialization
        self._owner = owner
        self._cache: dict[Any, Specialized] = {}
        self._lock = threading.Lock()
        self.__wrapped__ = wrapped if wrapped is not None else fn
        self.__name__ = getattr(self.__wrapped__, "__name__", name)
        self.__doc__ = getattr(self.__wrapped__, "__doc__", None)

    def specialize(
        self,
        in_specs: Any = None,
        out_specs_fn: Callable[..., Any] | None = None,
        devices: Sequence[Any] | None = None,
    ) -> ColocatedFunction:
        """A copy specialised further (each of these may be given once in a chain of calls).

        Args:
          in_specs: a pytree of ``jax.ShapeDtypeStruct`` for ``(args, kwargs)`` of a call.
          out_specs_fn: computes the output specs (``ShapeDtypeStruct`` s with
            shardings) from the input specs. Without it, the first call waits to learn them.
          devices: where a call with no array arguments runs (a sequence of
            devices, a ``Mesh``, or a ``pw.devices`` slice).

        Raises:
          SpecializationError: one of them was given before (``"in_specs already specified"``, ...).
        """
        return ColocatedFunction(
            self._fn,
            self._name,
            self._specialization.update(in_specs=in_specs, out_specs_fn=out_specs_fn, devices=devices),
            self._owner,
            self.__wrapped__,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the function on the hosts of its devices; its outputs as futures (at once, once known).

        Raises:
          SpecializationError: an argument is not an array, arrays on different
            device lists, no arrays and no ``devices``, or arguments that are not
            the specialised ``in_specs`` (JAX's messages).
          ProgramFailedError: the first call of a specialisation without
            ``out_specs_fn`` failed on a host, or a previous call with no outputs did.
          HostLostError: a host of the call is lost.
        """
        leaves, in_tree = jax.tree_util.tree_flatten((args, kwargs))
        given = self._specialization
        if not leaves and given.devices is None:
            raise errors.SpecializationError(
                "No devices found. colocated_python function without input arguments must be first "
                "specialized with devices."
            )
        specs = tuple(_spec_of(x) for x in leaves)
        if given.in_specs is not None:
            _check_in_specs(given, in_tree, specs, self._name)
        devices = given.devices if given.devices is not None else _infer_devices(specs)
        spec = self._specialized(in_tree, specs, devices)
        backend = clusters.cluster().backend
        runner = ray_colocated.runner_of(backend)
        self._owner.raise_pending()
        if runner is None:
            if backend.name != "local":
                raise errors.ClusterError(
                    f"colocated_python runs on the local backend and on a Ray backend's own hosts; "
                    f"this process's backend is {backend.name!r} (a controller service's client cannot "
                    "run it yet). Run it in the process that started the hosts."
                )
            return self._run_here(spec, args, kwargs, leaves)
        return self._run_on_hosts(runner, spec, leaves, specs)

    # --- specialisations -------------------------------------------------------------------

    def _specialized(self, in_tree: Any, specs: tuple, devices: tuple) -> Specialized:
        key = (in_tree, tuple((s.shape, s.dtype, s.sharding) for s in specs), devices)
        with self._lock:
            spec = self._cache.get(key)
            if spec is None:
                spec = self._cache[key] = Specialized(self._fn, self._name, in_tree, specs, devices)
                out_specs_fn = self._specialization.out_specs_fn
                if out_specs_fn is not None:
                    args_specs, kwargs_specs = jax.tree_util.tree_unflatten(in_tree, specs)
                    out = out_specs_fn(*args_specs, **kwargs_specs)
                    out_leaves, spec.out_tree = jax.tree_util.tree_flatten(out)
                    spec.out_specs = tuple(_checked_out_spec(x, self._name) for x in out_leaves)
        return spec

    # --- here (the local backend) ------------------------------------------------------------

    def _run_here(self, spec: Specialized, args: Any, kwargs: Any, leaves: list) -> Any:
        arrays = [x.result() if isinstance(x, Future) else x for x in leaves]
        args, kwargs = jax.tree_util.tree_unflatten(spec.in_tree, arrays)
        fn = self._fn
        if isinstance(fn, Method):
            obj = _local_objects.get(fn.instance)
            if obj is None:
                obj = _local_objects[fn.instance] = fn.cls(*fn.args, **fn.kwargs)
            result = getattr(obj, fn.name)(*args, **kwargs)
        else:
            result = fn(*args, **kwargs)
        if spec.out_specs is None:  # as JAX's first call: the outputs must be arrays
            out, spec.out_tree = jax.tree_util.tree_flatten(result)
            spec.out_specs = tuple(_spec_of(x) for x in out)
        return result

    # --- on the hosts (the Ray backend) ------------------------------------------------------

    def _run_on_hosts(self, runner: Any, spec: Specialized, leaves: list, specs: tuple) -> Any:
        what = f"colocated_python function {self._name!r}"
        settled = [_settled(x, i, what) for i, x in enumerate(leaves)]
        target = runner.target(spec.devices, what)
        self._owner.touched(runner, target.hosts)
        with spec.lock:
            if spec.out_specs is None:  # the first call: learns the outputs, then keeps them
                found, adopt = runner.call(spec, target, settled, None)
                found_out: list[tuple[Any, Any]] = [
                    (jax.core.ShapedArray(shape, np.dtype(dtype)), runner.sharding(target.island, desc))
                    for shape, dtype, desc in found.leaves
                ]
                spec.out_tree = found.out_tree
                spec.out_specs = tuple(
                    jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in found_out
                )
                sent = adopt(found_out)
                return jax.tree_util.tree_unflatten(spec.out_tree, _futures(sent.handles, self._name))
        if spec.out is None:
            spec.out = [(jax.core.ShapedArray(s.shape, s.dtype), s.sharding) for s in spec.out_specs]
        out = spec.out
        sent = runner.call(spec, target, settled, out)
        if not out:
            self._owner.pending_call(runner, sent, what)
        return jax.tree_util.tree_unflatten(spec.out_tree, _futures(sent.handles, self._name))

    def reply(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Runs the function on each host of its devices and returns each host's Python result
        (small values only), in host order; waits for them. Here: ``[result]``."""
        leaves, in_tree = jax.tree_util.tree_flatten((args, kwargs))
        given = self._specialization
        specs = tuple(_spec_of(x) for x in leaves)
        devices = given.devices if given.devices is not None else _infer_devices(specs)
        spec = self._specialized(in_tree, specs, devices)
        runner = ray_colocated.runner_of(clusters.cluster().backend)
        self._owner.raise_pending()
        if runner is None:
            arrays = [x.result() if isinstance(x, Future) else x for x in leaves]
            a, k = jax.tree_util.tree_unflatten(in_tree, arrays)
            fn = self._fn
            if isinstance(fn, Method):
                obj = _local_objects.get(fn.instance)
                if obj is None:
                    obj = _local_objects[fn.instance] = fn.cls(*fn.args, **fn.kwargs)
                return [getattr(obj, fn.name)(*a, **k)]
            return [fn(*a, **k)]
        what = f"colocated_python function {self._name!r}"
        settled = [_settled(x, i, what) for i, x in enumerate(leaves)]
        target = runner.target(spec.devices, what)
        self._owner.touched(runner, target.hosts)
        answers = runner.call(spec, target, settled, None, reply=True)
        return [answers[host] for host in target.hosts]

    def __repr__(self) -> str:
        return f"colocated_python({self._name})"


class _Owner:
    """What the calls of one function (or of one instance's methods) share: where they went,
    and the answers of calls with no outputs, whose failures the next call raises."""

    def __init__(self) -> None:
        self.hosts: set[tuple[Any, int]] = set()  # (runner, host) that got a call
        self.pending: list[tuple[Any, int, Any, int, str]] = []

    def touched(self, runner: Any, hosts: tuple[int, ...]) -> None:
        for host in hosts:
            self.hosts.add((runner, host))

    def pending_call(self, runner: Any, sent: Any, what: str) -> None:
        for host, answer in sent.answers.items():
            self.pending.append((runner, host, answer, sent.generation, what))

    def raise_pending(self) -> None:
        """Raises the failure of a call with no outputs that has answered since (and forgets it)."""
        still = []
        failure = None
        for runner, host, answer, generation, what in self.pending:
            if not answer.done():
                still.append((runner, host, answer, generation, what))
                continue
            failure = failure or runner.failure(host, answer, generation, what)
        self.pending = still
        if failure is not None:
            raise failure


def colocated_python(fun: Callable[..., Any]) -> ColocatedFunction:
    """Wraps ``fun`` to run on the hosts of the devices of its arguments (or of ``devices``).

    Args:
      fun: the function; it must pickle with cloudpickle (it travels to the hosts
        once per specialisation). It takes and returns pytrees of ``jax.Array``.

    Returns:
      A :class:`ColocatedFunction` with no specialisation.

    Raises:
      TypeError: ``fun`` is not callable.

    Example:
      >>> import jax, jax.numpy as jnp, pathways_jax as pw
      >>> s = pw.devices(mesh={"x": 1})
      >>> @pw.colocated_python.colocated_python
      ... def add_one(x):
      ...     return x + 1
      >>> x = jax.device_put(jnp.arange(3), s.sharding(None))
      >>> add_one(x).tolist()
      [1, 2, 3]
      >>> s.release()
    """
    if not callable(fun):
        raise TypeError(f"colocated_python takes a function, got {type(fun).__name__}: {fun!r}.")
    return ColocatedFunction(fun, getattr(fun, "__name__", "unknown"), Specialization(), _Owner())


# --- helpers ------------------------------------------------------------------------------


def _device_list(devices: Any) -> tuple[Any, ...]:
    """``devices`` (a sequence, a ``Mesh``, a ``pw.devices`` slice) as a tuple of devices."""
    if isinstance(devices, jax.sharding.Mesh):
        return tuple(devices.devices.flat)
    if hasattr(devices, "physical_mesh") and hasattr(devices, "devices"):  # a VirtualSlice
        return tuple(devices.devices)
    if isinstance(devices, np.ndarray):
        return tuple(devices.flat)
    return tuple(devices)


def _spec_of(x: Any) -> jax.ShapeDtypeStruct:
    """An argument's spec; it must be an array (a ``jax.Array`` or a ``pw.Future``), as JAX has it."""
    if not isinstance(x, jax.Array | Future):
        raise errors.SpecializationError(
            f"colocated_python only supports jax.Array as input and output, but got {type(x)}."
        )
    return jax.ShapeDtypeStruct(shape=x.shape, dtype=x.dtype, sharding=x.sharding)


def _infer_devices(specs: tuple) -> tuple[Any, ...]:
    lists = {tuple(s.sharding._device_assignment) for s in specs}
    if len(lists) != 1:
        raise errors.SpecializationError(
            f"All arguments must use the same device list, but got multiple device lists: {lists}."
        )
    return lists.pop()


def _check_in_specs(given: Specialization, in_tree: Any, specs: tuple, name: str) -> None:
    want = tuple((s.shape, np.dtype(s.dtype)) for s in given.in_specs or ())
    got = tuple((s.shape, np.dtype(s.dtype)) for s in specs)
    if in_tree != given.in_tree or want != got:
        raise errors.SpecializationError(
            f"colocated_python function {name!r} was specialized with in_specs {given.in_tree} "
            f"{list(want)}, but called with {in_tree} {list(got)}. Call it with arguments of those "
            "specs, or use a copy not specialized with in_specs."
        )


def _checked_out_spec(x: Any, name: str) -> jax.ShapeDtypeStruct:
    sharding = getattr(x, "sharding", None)
    if not hasattr(x, "shape") or not hasattr(x, "dtype") or sharding is None:
        raise errors.SpecializationError(
            f"out_specs_fn of colocated_python function {name!r} returned {x!r}; it returns "
            "jax.ShapeDtypeStruct(shape, dtype, sharding=...) leaves, each with a sharding."
        )
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _settled(x: Any, index: int, what: str) -> Any:
    """An input once its run is dispatched: a handle on the hosts, or an array here."""
    if not isinstance(x, Future):
        return x
    return futures.sent(x, _SETTLE_TIMEOUT_S, f"input {index} of {what}")


def _futures(handles: list, name: str) -> list[Future]:
    """Futures of a call's outputs: values on the hosts, held by this process's current client."""
    client = clients.current()
    store = clusters.cluster().store
    return [
        futures.adopted(
            store,
            Owner(client.name, -1 - next(_outputs), client.key),
            handle,
            f"output {index} of colocated_python function {name!r}",
        )
        for index, handle in enumerate(handles)
    ]


__all__ = ["ColocatedFunction", "colocated_cpu_devices", "colocated_python"]
