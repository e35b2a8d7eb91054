"""``pw.colocated_python.colocated_python_class``: objects that live on the hosts, as JAX's API has it.

An instance of the wrapped class is a handle here; the object itself is
made on each host of a method call's devices, from the constructor's
arguments, at the first method call there (on the local backend: in this
process). Its methods run there in the order they are called (each host's
one order of messages), keeping the object's state between calls. When the
handle here is deleted, each host drops its object with its next freed
values. A host rebuilt after a loss makes the object anew at its next call:
state that must survive that is the object's to save and restore (as
``pw.colocated_python.HostIterator`` does for an input iterator).
"""

from __future__ import annotations

import inspect
import itertools
import weakref
from typing import Any

from pathways_jax._src.api.colocated import ColocatedFunction, Specialization, _local_objects, _Owner
from pathways_jax._src.backends.ray_host.colocated import Method

_instances = itertools.count()
_NOT_METHODS = ("__init__", "__del__", "__reduce__", "__reduce_ex__")


def colocated_python_class(cls: type) -> type:
    """Wraps ``cls`` so that its instances live on the hosts of the devices its methods are called with.

    Args:
      cls: the class; it (and its constructor's arguments) must pickle with cloudpickle.

    Returns:
      A class of the same name whose instances hold the constructor's
      arguments; each method is a colocated function (``.specialize`` works on it).

    Example:
      >>> import jax, jax.numpy as jnp, pathways_jax as pw
      >>> @pw.colocated_python.colocated_python_class
      ... class Counter:
      ...     def __init__(self, start):
      ...         self.count = start
      ...     def add(self, x):
      ...         self.count += int(x.sum())
      ...         return jnp.full(x.shape, self.count)
      >>> s = pw.devices(mesh={"x": 1})
      >>> counter = Counter(10)
      >>> x = jax.device_put(jnp.ones(2, jnp.int32), s.sharding(None))
      >>> counter.add(x).tolist(), counter.add(x).tolist()
      ([12, 12], [14, 14])
      >>> s.release()
    """
    if not inspect.isclass(cls):
        raise TypeError(f"colocated_python_class takes a class, got {type(cls).__name__}: {cls!r}.")

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        instance = -1 - next(_instances)  # negative: never a value's key on a host
        owner = _Owner()
        self._colocated_python_uid = instance
        for name in dir(cls):
            member = getattr(cls, name)
            if name in _NOT_METHODS or not inspect.isfunction(member):
                continue
            method = Method(cls, args, kwargs, instance, name)
            wrapped = ColocatedFunction(method, f"{cls.__name__}.{name}", Specialization(), owner, member)
            setattr(self, name, wrapped)
        weakref.finalize(self, _release, instance, owner.hosts)

    namespace = {"__init__": __init__, "__doc__": cls.__doc__, "__module__": cls.__module__}
    return type(cls.__name__, (), namespace)


def _release(instance: int, hosts: set[tuple[Any, int]]) -> None:
    """An instance handle went: its objects go, here and on the hosts that made one."""
    _local_objects.pop(instance, None)
    for runner, host in hosts:
        runner.dispatcher.drop(host, instance)


__all__ = ["colocated_python_class"]
