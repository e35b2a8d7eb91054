"""The local backend: in-process JAX devices, islands carved from ``jax.devices()``."""

from __future__ import annotations

import collections
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from pathways_jax._src.backends.base import (
    Dispatched,
    Prepared,
    RunView,
    StartOptions,
    StepFailed,
    Windows,
    device_window_key,
)
from pathways_jax._src.compile.steps import ExecStep, MoveStep
from pathways_jax._src.core import counts, errors, events, host_memory, readiness, reentry, source
from pathways_jax._src.core.formatting import aval_text

if TYPE_CHECKING:
    from pathways_jax._src.compile.lowering import Plan


class LocalBackend:
    """The devices of this process: each step of a run is dispatched on the dispatching thread.

    Implements :class:`~pathways_jax._src.backends.base.Backend`. Dispatch is
    asynchronous (JAX's): executing a step enqueues it on its devices.
    """

    name = "local"
    window_size: int | None = None  # the controller counts executables: pw.init(max_in_flight=...)
    donates = True
    exports = False
    calls_back = True
    stages_inputs = True

    def __init__(self, islands: tuple[tuple[jax.Device, ...], ...] = ()) -> None:
        self.islands = islands
        self.lost: dict[int, str] = {}  # in-process devices do not die apart from this process
        self.on_lost: Callable[[int], None] | None = None

    def prepare(self, plan: Plan) -> Prepared:
        reports = sum(isinstance(step, ExecStep | MoveStep) for step in plan.steps)
        # A run counts once in the window of each device its single-device
        # executables run on, by the output of its last one there (its
        # accounting group's): that bounds the runs queued on the device, so
        # that the scheduling policy chooses their order. Executables over
        # several devices count in their island's window, one by one (lowering).
        lanes = tuple(
            (device_window_key(group.devices[0]), index)
            for index, group in enumerate(plan.acct_groups)
            if len(group.devices) == 1
        )
        # Per step, the arguments its executable consumes (donation): see Windows.handed_on.
        donors = tuple(
            _donated_positions(step.executable, len(step.in_slots)) if isinstance(step, ExecStep) else ()
            for step in plan.steps
        )
        windowed = {**plan.windowed, **dict.fromkeys((key for key, _ in lanes), 1)}
        # A plan of one executable that needs none of the loop's cases (a device's
        # window only, nothing pinned nor donated, no staged inputs) is run by
        # _direct: the repeat call of a pw.jit or a train step, in fewer steps.
        only = plan.steps[0] if len(plan.steps) == 1 else None
        direct = (
            only
            if isinstance(only, ExecStep)
            and not only.windowed
            and not only.pinned
            and not any(donors)
            and not plan.staged_feeds
            else None
        )
        part = _LocalPart(lanes, donors if any(donors) else None, direct, _arguments_of(plan.steps))
        return Prepared(windowed, plan.islands, reports, part)

    def execute(self, run: RunView, windows: Windows) -> Dispatched:
        plan = run.plan
        env = run.env
        sink = events.SINK
        step: Any = None
        dispatched = 0
        part: _LocalPart | None = plan.prepared.part
        if part is not None and part.direct is not None and sink is None:
            return _direct(run, windows, part, part.direct)
        calls = part.calls if part is not None else None
        if calls is None:
            calls = [getattr(step, "executable", None) for step in plan.steps]
        arguments = part.arguments if part is not None else _arguments_of(plan.steps)
        donors = part.donors if part is not None and part.donors is not None else ()
        hand_on = getattr(windows, "handed_on", None) if donors else None
        try:
            if plan.staged_feeds:  # under a memory budget: host inputs go on devices once admitted
                for _, slot, sharding in plan.host_feeds:
                    env[slot] = jax.device_put(env[slot], sharding)
                if run.staged is not None:  # the run is admitted: its host copies leave the bound
                    run.staged.release()
            for index, step in enumerate(plan.steps):
                if isinstance(step, ExecStep):
                    if step.windowed:
                        windows.make_room(step.island)
                    if sink is not None:
                        t0 = events.now()
                    read = arguments[index]
                    args = (env[read],) if type(read) is int else read(env)
                    try:
                        outs = calls[index](*args)
                    except _NAN_CHECK as exc:  # jax_debug_nans / jax_debug_infs found one
                        raise _nan_error(step, args, exc) from None
                    if step.pinned:
                        outs = list(outs)
                        for position, device in step.pinned:
                            outs[position] = next(
                                shard.data
                                for shard in outs[position].addressable_shards
                                if shard.device == device
                            )
                    for slot, array in zip(step.out_slots, outs, strict=True):
                        env[slot] = array
                    if hand_on is not None and outs and donors[index]:
                        hand_on([args[position] for position in donors[index]], outs[0])
                    if outs and step.windowed:
                        windows.in_flight(step.island, outs[0], run)
                    dispatched += 1
                    if sink is not None:
                        sink(_ran(run, step, outs, t0))
                else:
                    if sink is not None:
                        t0 = events.now()
                    try:
                        env[step.dst] = jax.device_put(env[step.src], step.sharding)
                    except Exception as exc:
                        raise errors.TransferError(
                            f"moving a value ({step.kind or 'reshard'}) onto {step.sharding} failed: {exc}"
                        ) from exc
                    if step.kind is not None:
                        counts.bump(f"transfers_{step.kind}")
                    if sink is not None:
                        sink(_moved(run, step, env[step.src], env[step.dst], t0))
        except Exception as exc:  # a user error fails its run only
            if reentry.from_signal_handler(exc):
                raise  # the caller's own (a time budget's alarm): the run is interrupted, as by Ctrl-C
            raise _failed(run, step, exc) from exc
        finally:
            counts.bump("dispatches", dispatched)
        if part is not None and part.calls is None:
            # Every executable has run once: JAX has made each one's C++ call (see _fast_calls).
            part.calls = _fast_calls(plan.steps)
        # A plan that places nothing (it returns literals or its arguments) was
        # prepared by no backend: it has no lanes, nor anything to dispatch.
        return _dispatched(run, windows, part.lanes if part is not None else ())

    def settle(self, in_flight: collections.deque) -> None:
        # Oldest first, up to the first one still running (every look is a call into XLA).
        # readiness.settled, its common case inlined: asked on every window that looks full.
        if in_flight:
            readiness.hold_frames()  # no collection inside jaxlib's traceback capture (see there)
        while in_flight:
            marker = in_flight[0][0]
            try:
                # Deleted first: asking a deleted array whether it is ready crashes XLA's CPU client;
                # both in one call into C, where its user cannot delete() it in between.
                done = any(map(operator.call, (marker.is_deleted, marker.is_ready)))
            except AttributeError:  # an extended dtype, or a kind that cannot be asked
                done = readiness.settled(marker)
            except Exception as exc:  # it failed: it is over
                if reentry.from_signal_handler(exc):
                    raise  # the caller's own (a time budget's alarm), not the run's failure
                done = True
            if not done:
                return
            in_flight.popleft()

    def close(self, timeout: float | None) -> None:
        pass  # JAX owns the devices; their values go with their futures


class _LocalPart:
    """What the local backend adds to a plan (``Prepared.part``)."""

    __slots__ = ("arguments", "calls", "direct", "donors", "lanes")

    def __init__(
        self,
        lanes: tuple[tuple[int, int], ...],
        donors: tuple[tuple[int, ...], ...] | None,
        direct: ExecStep | None,
        arguments: tuple[Any, ...],
    ) -> None:
        # (device window key, accounting group) for each single-device group: the
        # run counts once in that device's window, by the group's last output.
        self.lanes = lanes
        # Per step, the argument positions its executable consumes (donation); None if none do.
        self.donors = donors
        # The plan's one step, when _direct may run it (see LocalBackend.prepare); else None.
        self.direct = direct
        # Per step, how its arguments are read from the run's environment (see _arguments_of).
        self.arguments = arguments
        # Per step, what is called to run its executable: set once every step has run (_fast_calls).
        self.calls: list[Any] | None = None


def _arguments_of(steps: Sequence[Any]) -> tuple[Any, ...]:
    """Per step, what reads its executable's arguments from a run's environment (None: not an ``ExecStep``).

    A slot number for one argument; else an ``operator.itemgetter`` of the
    slots, which reads them in one C call (a list comprehension is a Python
    frame per step of every run). The readers: ``(env[read],)`` for a slot,
    ``read(env)`` else.
    """
    read: list[Any] = []
    for step in steps:
        if not isinstance(step, ExecStep):
            read.append(None)
        elif len(step.in_slots) == 1:
            read.append(step.in_slots[0])
        else:
            read.append(_tuple_of(step.in_slots))
    return tuple(read)


def _tuple_of(slots: tuple[int, ...]) -> Callable[[list[Any]], tuple[Any, ...]]:
    """What reads these slots (none, or two or more) of an environment as a tuple."""
    if not slots:
        return lambda env: ()
    return operator.itemgetter(*slots)


def _fast_calls(steps: Sequence[Any]) -> list[Any]:
    """Per step, the C++ call JAX made for its compiled executable at its first call, or the executable.

    ``jax.stages.Compiled.__call__`` makes that call once and then only calls
    it: calling it directly saves a Python frame per step of every run.
    """
    calls = []
    for step in steps:
        executable = getattr(step, "executable", None)
        fast = getattr(executable, "_call", None) if isinstance(executable, jax.stages.Compiled) else None
        calls.append(fast if callable(fast) else executable)
    return calls


def _direct(run: RunView, windows: Windows, part: _LocalPart, step: ExecStep) -> Dispatched:
    """``LocalBackend.execute`` of a plan of one executable with no window of its island's,
    nothing pinned, donated or staged, and no trace sink: what the loop does for it, and no more.
    """
    env = run.env
    read = part.arguments[0]
    args = (env[read],) if type(read) is int else read(env)
    calls = part.calls
    try:
        try:
            outs = (step.executable if calls is None else calls[0])(*args)
        except _NAN_CHECK as exc:  # jax_debug_nans / jax_debug_infs found one
            raise _nan_error(step, args, exc) from None
    except Exception as exc:  # a user error fails its run only (as in execute)
        if reentry.from_signal_handler(exc):
            raise
        raise _failed(run, step, exc) from exc
    for slot, array in zip(step.out_slots, outs, strict=True):
        env[slot] = array
    counts.bump("dispatches", 1)
    if calls is None:
        part.calls = _fast_calls((step,))
    return _dispatched(run, windows, part.lanes)


def _failed(run: RunView, step: Any, exc: Exception) -> StepFailed:
    """The failure of ``run`` at ``step`` (its own: the run fails alone), naming a deleted argument if that was why."""
    plan = run.plan
    cause = _deleted_argument(plan, run.env)
    if cause is not None:
        cause.__cause__ = exc
    return StepFailed(_where(plan.graph.name, run.id, step), cause or exc)


def _dispatched(run: RunView, windows: Windows, lanes: tuple[tuple[int, int], ...]) -> Dispatched:
    """A dispatched run's values, and its device windows told of it (each lane's group marker)."""
    env = run.env
    last = tuple([env[slot] for _, slot, _ in run.plan.acct_groups])
    for key, group in lanes:
        windows.in_flight(key, last[group], run)
    return Dispatched(env, last)


def _donated_positions(executable: Any, count: int) -> tuple[int, ...]:
    """The arguments a compiled executable consumes (its ``donate_argnums``).

    An executable that does not say (a sub-byte dtype's, called through its
    ``jax.jit``) counts as taking all of them: handing a window entry on to an
    executable that only reads its marker is still right (it runs after the
    marker's maker), only later to settle.
    """
    info = getattr(executable, "args_info", None)
    if info is None:
        return tuple(range(count))
    return tuple(i for i, arg in enumerate(jax.tree_util.tree_leaves(info[0])) if arg.donated)


try:  # what a compiled call raises when jax_debug_nans or jax_debug_infs finds one (private to JAX)
    from jax._src.api_util import InternalFloatingPointError

    _NAN_CHECK: tuple[type[Exception], ...] = (InternalFloatingPointError,)
except ImportError:  # pragma: no cover - another JAX
    _NAN_CHECK = ()


def _nan_error(step: Any, args: Sequence[Any], exc: Exception) -> FloatingPointError:
    """What ``jax.jit`` raises for a NaN or Inf under ``jax_debug_nans``: the operation that made it.

    As ``jax.jit`` does, the node is run again op by op on the same inputs; the
    first operation with an invalid output is named with the user's line
    ("invalid value (nan) encountered in log at train.py:12 (loss)"). Inputs a
    donation consumed cannot be read again: then only the node is named.
    """
    where = f"node {step.node.name!r} ({step.node.source_info})"
    kind = getattr(exc, "ty", "nan")
    if not any(isinstance(a, jax.Array) and a.is_deleted() for a in args):
        try:
            found = _first_invalid(step.node.jaxpr, args)
        except Exception:  # the op-by-op run failed otherwise: name the node only
            found = None
        if found is not None:
            eqn, what = found
            return FloatingPointError(
                f"{what} at {source.of_equation(eqn, step.node.source_info)}, in {where} (found by running it "
                "again op by op, as jax.jit does under jax_debug_nans/jax_debug_infs)"
            )
    return FloatingPointError(
        f"invalid value ({kind}) encountered in the output of {where} (jax_debug_nans/jax_debug_infs "
        "is on); running it again op by op did not find the operation."
    )


def _first_invalid(closed: Any, args: Sequence[Any]) -> tuple[Any, str] | None:
    """The first equation of ``closed`` whose output holds a NaN (or an Inf, as the flags ask), and what it made."""
    nans = bool(jax.config.jax_debug_nans)  # type: ignore[attr-defined]
    infs = bool(jax.config.jax_debug_infs)  # type: ignore[attr-defined]
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(var: Any) -> Any:
        return var.val if isinstance(var, jex.Literal) else env[var]

    for eqn in jaxpr.eqns:
        try:
            outs = eqn.primitive.bind(*[read(v) for v in eqn.invars], **eqn.params)
        except FloatingPointError as exc:  # JAX's own check found it (inside a nested jax.jit: its operation)
            return eqn, str(exc).split(". Because")[0]
        outs = outs if eqn.primitive.multiple_results else [outs]
        for out in outs:
            if not jnp.issubdtype(getattr(out, "dtype", np.int32), jnp.inexact):
                continue
            if nans and bool(jnp.isnan(out).any()):
                return eqn, f"invalid value (nan) encountered in {eqn.primitive.name}"
            if infs and bool(jnp.isinf(out).any()):
                return eqn, f"invalid value (inf) encountered in {eqn.primitive.name}"
        env.update(zip(eqn.outvars, outs, strict=True))
    return None


def _ran(run: RunView, step: ExecStep, outs: Sequence[Any], start: int) -> events.Dispatched:
    """The trace event of ``step`` of ``run``, dispatched from ``start`` until now."""
    plan, node = run.plan, step.node
    return events.Dispatched(
        run.id,
        run.client.name,
        plan.graph.name,
        node.name,
        node.kind,
        node.source_info,
        node.slice.id,
        step.island,
        plan.placement.device_ids(node.slice.id),
        start,
        events.now(),
        tuple(outs),
    )


def _moved(run: RunView, step: MoveStep, src: Any, dst: Any, start: int) -> events.Moved:
    """The trace event of ``step`` of ``run`` (``src`` moving to ``dst``), dispatched from ``start``."""
    return events.Moved(
        run.id,
        run.client.name,
        run.plan.graph.name,
        step.kind or "reshard",
        int(getattr(src, "nbytes", 0)),
        aval_text(getattr(src, "aval", None)),
        _device_ids(getattr(src, "sharding", None)),
        _device_ids(step.sharding),
        start,
        events.now(),
        (dst,),
    )


def _device_ids(sharding: Any) -> tuple[int, ...]:
    try:
        return tuple(sorted(d.id for d in sharding.device_set))
    except Exception:
        return ()


def _deleted_argument(plan: Any, env: list[Any]) -> RuntimeError | None:
    """Why a run failed if a ``jax.Array`` the caller passed was deleted before its dispatch; else None.

    A queued run reads its arguments when it is dispatched, where a ``jax.jit``
    call has XLA hold them from the call on: deleting an argument, or donating
    it to another call, in between leaves the run nothing to read.
    """
    for index, slot in plan.array_feeds:
        value = env[slot]
        deleted = getattr(value, "is_deleted", None)  # duck-typed: this runs on any failure of a run
        if deleted is not None and deleted():
            return RuntimeError(
                f"argument {index} of the call ({value.aval.str_short()}), a jax.Array, was deleted "
                "or donated to another call before its run was dispatched: before the call (jax.jit "
                "refuses a deleted array), or after it returned, while the run was queued (a queued "
                "run reads its arguments when it is dispatched). Pass a live array; keep it until "
                "the run's result is ready (read it, or jax.block_until_ready(out)) before deleting "
                "or donating it, or pass a copy (jnp.copy(x))."
            )
    return None


def _where(program: str, run_id: int, step: Any) -> str:
    """Which program, run and step failed, in the user's words."""
    if isinstance(step, ExecStep):
        return f"program {program!r} run {run_id} failed in node {step.node.name!r} ({step.node.source_info})"
    if isinstance(step, MoveStep):
        return f"program {program!r} run {run_id} failed moving a value ({step.kind or 'reshard'})"
    return f"program {program!r} run {run_id} failed"


def start(options: StartOptions) -> LocalBackend:
    """The local backend of ``pw.init(backend="local", ...)`` (``registry``): this process's devices."""
    if (
        options.address is not None
        or options.hosts is not None
        or options.devices_per_host != 1
        or isinstance(options.devices_per_host, bool)
        or options.platform != "cpu"
        or options.replace_lost_hosts is not True
    ):
        raise errors.ClusterError(
            "address=, hosts=, devices_per_host=, platform= and replace_lost_hosts= describe Ray hosts; "
            "pass backend='ray' with them, or leave them out for the local backend (it uses this "
            "process's JAX devices)."
        )
    if options.service is not None:
        raise errors.ClusterError(
            f"service={options.service!r} was given to the local backend, which joins no service: a "
            "controller service is joined through Ray, with pw.init(backend='ray', address=..., "
            f"service={options.service!r}). Add backend='ray', or leave service= out."
        )
    if options.num_cpu_devices is not None:
        set_cpu_device_count(options.num_cpu_devices)
    carved = carve_islands(local_devices(), options.islands)
    if all(d.platform == "cpu" for group in carved for d in group):
        host_memory.release_large_buffers()  # CPU device buffers are host memory
    return LocalBackend(carved)


def _backend_started() -> bool:
    # JAX exposes no public query for this; fall back to "started" so that a
    # mismatched device count is reported instead of silently ignored.
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return True


def set_cpu_device_count(count: int) -> None:
    """Makes JAX's CPU backend expose ``count`` devices, if it has not started yet."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise errors.ClusterError(f"num_cpu_devices must be a positive int, got {count!r}.")
    if not _backend_started():
        jax.config.update("jax_num_cpu_devices", count)
        return
    have = len(jax.devices("cpu"))
    if have != count:
        raise errors.ClusterError(
            f"pw.init(num_cpu_devices={count}) came after JAX's backend started "
            f"with {have} CPU devices; the count cannot change in a running "
            "process. Call pw.init(num_cpu_devices=...) before any JAX "
            "computation, or set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{count} (or jax.config.update('jax_num_cpu_devices', {count})) "
            "before JAX starts."
        )


def local_devices() -> list[jax.Device]:
    """The devices of JAX's default backend in this process, ordered by id."""
    return sorted(jax.devices(), key=lambda d: d.id)


def carve_islands(
    devices: Sequence[jax.Device], islands: int | Sequence[Sequence[int]] | None
) -> tuple[tuple[jax.Device, ...], ...]:
    """Splits ``devices`` into islands as ``pw.init(islands=...)`` describes."""
    if islands is None:
        return (tuple(devices),)
    if isinstance(islands, int) and not isinstance(islands, bool):
        if islands < 1:
            raise errors.ClusterError(
                f"islands={islands}: a cluster has at least 1 island; pass a divisor of the "
                f"{len(devices)} local devices, or a list of lists of device ids."
            )
        if len(devices) % islands:
            raise errors.ClusterError(
                f"islands={islands} must evenly divide the {len(devices)} local "
                "devices; pass a divisor of the device count, or a list of "
                "lists of device ids."
            )
        per = len(devices) // islands
        return tuple(tuple(devices[i * per : (i + 1) * per]) for i in range(islands))
    if not isinstance(islands, Sequence) or not all(
        isinstance(group, Sequence) and not isinstance(group, str) for group in islands
    ):
        raise errors.ClusterError(
            f"islands must be None, an int, or a list of lists of device ids; got {islands!r}."
        )
    by_id = {d.id: d for d in devices}
    seen: set[int] = set()
    carved = []
    for number, group in enumerate(islands):
        if not group:
            raise errors.ClusterError(f"island {number} in islands={islands!r} is empty.")
        members = []
        for device_id in group:
            if device_id not in by_id:
                raise errors.ClusterError(
                    f"island {number} names device id {device_id!r}, but the local "
                    f"devices have ids {sorted(by_id)}."
                )
            if device_id in seen:
                raise errors.ClusterError(
                    f"device id {device_id} appears in more than one island of "
                    f"islands={islands!r}; islands must be disjoint."
                )
            seen.add(device_id)
            members.append(by_id[device_id])
        carved.append(tuple(members))
    return tuple(carved)
