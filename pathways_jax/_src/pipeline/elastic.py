"""``pw.elastic``: data-parallel training that goes on when an island is lost, and takes it back.

A :class:`Manager` drives a :class:`~pathways_jax.pipeline.DataParallel`
model, one replica per island. When an island's host dies mid-training, the
steps it spoiled are run again on the surviving replicas, from their own
copies of the state (no checkpoint, no step lost), with the same global
batch cut into fewer, larger shards; the user's loop does not see it. When
the island is rebuilt, a replica joins it again at a step boundary (once the
steps in flight are complete), its state copied from a survivor over the
transfer servers.

Semantics:

- **Steps.** Every call of :meth:`Manager.train_step` is one step, applied
  exactly once to the state, in order. A step whose run failed because a
  replica's island was lost is run again, with the same batch, on the
  replicas left; the loss it returns (a :class:`Loss`) reads the step's
  value from whichever run completed it.
- **Arithmetic.** With K replicas a step averages K shard gradients; with
  K - 1 it averages K - 1 larger shards. Both are the mean gradient of the
  whole batch, in another order of additions: a run that lost an island
  equals the uninterrupted one within float rounding, not bit for bit (in
  ``benchmarks/elastic.py``, float32, every loss of 566 steps through 100
  losses and rejoins within 2.2e-7 of plain JAX run with the same replica
  counts). Replicas hold
  bit-identical parameters at every step, before and after, and a replica
  that rejoins starts from a bit-identical copy.
- **Memory.** So that steps can be run again, the state before every
  ``window``-th step is kept until a later one is known complete, with the
  batches since: at most two copies of the parameters and optimizer state
  per replica beside the live one, and ``2 * window`` batches. A failure runs
  again at most the ``2 * window`` steps since the older copy.
- **Batch.** The global batch must split evenly over every replica count
  the run may have, from ``minimum_islands`` to all of them (checked at the
  first step).

The shape follows ``pathwaysutils.elastic.Manager``: :meth:`Manager.elastic_retry`
wraps a function to run it again after a failure the manager could not
absorb (fewer than ``minimum_islands`` replicas left, or a host lost under
the user's own programs), once enough islands are up.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

import pathways_jax as pw
from pathways_jax._src.compat.jax_futures import take_as_array
from pathways_jax._src.pipeline import rngs as rngs_lib
from pathways_jax._src.pipeline import stages as stages_lib
from pathways_jax._src.pipeline.data_parallel import DataParallel
from pathways_jax._src.runtime.array_like import ArrayLike

_F = TypeVar("_F", bound=Callable[..., Any])
RetryPolicy = Callable[[int, BaseException], bool]
_POLL_S = 0.05  # how often the manager looks at the islands while it waits for them
# A run failed with HostLostError: how long the manager waits for the cluster to take that
# island out (its slices moved) before it treats the failure as the step's own.
_LOSS_SEEN_S = 10.0


class Event(NamedTuple):
    """Something the manager did: a replica lost (``"lost"``) or one back (``"rejoined"``).

    ``step``: the first step it affected; ``islands``: the replicas' islands
    after it; ``seconds``: how long the manager took over it (for a loss: from
    when it found the failure until the steps it spoiled were dispatched again).
    """

    step: int
    kind: Literal["lost", "rejoined"]
    islands: tuple[int, ...]
    seconds: float


@dataclasses.dataclass(slots=True)
class _Step:
    """A dispatched step not yet known complete: what it needs to run again."""

    index: int
    x: Any
    y: Any
    options: dict[str, Any]
    params: list[Any] | None  # the state it started from, one entry per replica; None: not kept
    opt_states: list[Any] | None
    islands: tuple[int, ...]  # each replica's island when it was dispatched
    loss: Any = None  # its loss future (replaced when the step runs again)
    done_marks: tuple[Any, ...] = ()  # one output of each replica's update: all done = step done
    complete: bool = False  # known complete: its loss and every replica's state computed
    count: int | None = None  # the model's steps before it (DiLoCo syncs by it): the same when run again


class Loss(ArrayLike):
    """The loss of one step of a :class:`Manager`: array-like, as the ``pw.Future`` ``train_step`` returns.

    If the run that computed it failed because an island was lost, reading it
    lets the manager run the step again on the surviving replicas, and gives
    that run's value. It answers as its value does (``float(loss)``,
    ``f"{loss:.4f}"``, ``loss.item()``, ``loss + 1``, ``jnp.stack(losses)``, a
    ``jax.jit`` argument), each waiting for it first, as a ``pw.Future`` does.
    """

    __slots__ = ("_manager", "_step")

    def __init__(self, manager: Manager, step: _Step):
        self._manager = manager
        self._step = step

    @property
    def step(self) -> int:
        """The step's number (0 for the first call of ``train_step``)."""
        return self._step.index

    @property
    def shape(self) -> tuple[int, ...]:
        """The loss's shape, ``()`` (known without waiting)."""
        return tuple(self._step.loss.shape)

    @property
    def dtype(self) -> np.dtype:
        """The loss's dtype (known without waiting)."""
        return np.dtype(self._step.loss.dtype)

    def done(self) -> bool:
        """True once the current run of the step has finished (or failed); never waits."""
        return bool(self._step.loss.done())

    def result(self, timeout: float | None = None) -> jax.Array:
        """The step's mean loss, as ``pw.Future.result`` (a lost island's failure is absorbed)."""
        return self._manager._result(self._step, timeout)

    def block_until_ready(self) -> Loss:
        self.result()
        return self

    def __repr__(self) -> str:
        return f"pw.elastic.Loss(step={self.step}, done={self.done()})"


take_as_array(Loss)  # jax.jit and jnp take a Loss as its array, as they take a pw.Future


class Manager:
    """Trains a :class:`~pathways_jax.pipeline.DataParallel` model through the loss of islands.

    Args:
      model: the data-parallel model, one replica per island (its slices on
        distinct islands of a Ray cluster; the local backend loses none).
      minimum_islands: the fewest replicas training goes on with. A loss that
        leaves fewer (but one or more) stalls it: the survivors keep the state,
        ``train_step`` raises ``HostLostError`` and takes no step until islands
        come back, then replicas rejoin and the open steps run again on all of
        them. :meth:`elastic_retry` does the waiting.
      window: the state before every ``window``-th step is kept to run steps
        again from; ``train_step`` waits for the oldest step not known
        complete once ``2 * window`` are outstanding.
      rejoin: when a lost island is rebuilt, a replica joins it again at the
        next step boundary (its state copied from the first replica).

    Raises:
      PlacementError: ``model`` is not a ``DataParallel``, two of its replicas
        share an island, or an argument is out of range.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, pathways_jax as pw
      >>> from pathways_jax.pipeline import DataParallel
      >>> _ = pw.init(islands=2)
      >>> a, b = pw.devices(mesh={"data": 1}, island=0), pw.devices(mesh={"data": 1}, island=1)
      >>> dp = DataParallel((jnp.ones(2), lambda p, x: x * p), [a, b],
      ...                   loss_fn=lambda out, y: jnp.mean((out - y) ** 2),
      ...                   optimizer=optax.sgd(0.5))
      >>> manager = pw.elastic.Manager(dp)
      >>> loss = manager.train_step(np.ones((2, 2)), np.zeros((2, 2)))
      >>> float(loss), manager.step, manager.islands
      (1.0, 1, (0, 1))
      >>> pw.shutdown()
    """

    def __init__(
        self, model: DataParallel, *, minimum_islands: int = 1, window: int = 8, rejoin: bool = True
    ):
        if not isinstance(model, DataParallel):
            raise pw.errors.PlacementError(
                f"pw.elastic.Manager drives a pathways_jax.pipeline.DataParallel model; got {type(model).__name__}."
            )
        count = len(model.slices)
        if not _is_int(minimum_islands) or not 1 <= minimum_islands <= count:
            raise pw.errors.PlacementError(
                f"minimum_islands must be an int from 1 to the model's {count} replicas; got {minimum_islands!r}."
            )
        if not _is_int(window) or window < 1:
            raise pw.errors.PlacementError(f"window must be an int >= 1; got {window!r}.")
        islands = [s.island for s in model.slices]
        if len(set(islands)) != len(islands):
            raise pw.errors.PlacementError(
                f"pw.elastic.Manager: the model's replicas are on islands {islands}; each must have an "
                "island of its own (an island lost takes every replica on it). Place them with "
                "pw.devices(..., island=i)."
            )
        self.model = model
        self.minimum_islands = minimum_islands
        self.window = window
        self.rejoin = rejoin
        self._homes = tuple(islands)  # each replica's own island, in the model's order
        first = model.slices[0]
        self._mesh = dict(zip(first.axis_names, first.shape, strict=True))
        self._axis_types = first.axis_types
        self._exclusive = first.exclusive
        self._pending: collections.deque[_Step] = collections.deque()
        self._step = model._steps  # a model restored from a checkpoint goes on from its step
        self._loads = model._loads
        self._checked_batches: set[int] = set()
        self._stalled = False  # fewer replicas than minimum_islands: the open steps wait for islands
        self.events: list[Event] = []

    @property
    def step(self) -> int:
        """How many steps were taken (calls of :meth:`train_step`; after ``model.load_state``, its step)."""
        self._follow_load()
        return self._step

    def _follow_load(self) -> None:
        """Goes on from a state ``model.load_state`` put in since (a rollback to a checkpoint): from its
        step, and no step taken before it runs again after a loss (that would undo the load)."""
        if self.model._loads == self._loads:
            return
        self._loads = self.model._loads
        self._pending.clear()  # their losses stay readable, as futures of the runs they had
        self._step = self.model._steps

    @property
    def islands(self) -> tuple[int, ...]:
        """The islands of the replicas training now, in order."""
        return tuple(s.island for s in self.model.slices)

    def train_step(self, x: Any, y: Any, **options: Any) -> Loss:
        """Runs one step on the replicas there are (as ``DataParallel.train_step``); returns its loss.

        Keyword options (``rngs``, ``train``, ``train_kw``) are passed on; an ``nnx.Rngs``
        draws its keys at this call, so a step run again uses the same keys. At
        this step boundary, first: steps known complete are let go, a lost
        island's spoiled steps are run again on the survivors, and a rebuilt
        island gets its replica back.

        Raises:
          HostLostError: fewer than ``minimum_islands`` replicas are left.
          PlacementError: the batch does not split evenly over every replica
            count from ``minimum_islands`` to all of them.
        """
        self._check_batch(x)
        self._follow_load()
        if self._stalled:
            self._rejoin()
            if self._stalled:
                raise pw.errors.HostLostError(self._stalled_message())
        self._settle(wait=False)
        while len(self._pending) >= 2 * self.window:  # the oldest steps complete, a kept state goes
            self._settle(wait=True)
        if self.rejoin:
            self._rejoin()
        if "rngs" in options:  # an nnx.Rngs draws its keys now, once: a replayed step reuses them
            options = {**options, "rngs": rngs_lib.drawn(options["rngs"])}
        step = _Step(self._step, x, y, options, None, None, ())
        self._dispatch(step, keep=not self._pending or self._step % self.window == 0)
        self._pending.append(step)
        self._step += 1
        return Loss(self, step)

    def wait(self, timeout: float | None = None) -> None:
        """Waits until every step taken is complete, running spoiled ones again as needed.

        Raises:
          FutureTimeoutError: not complete within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self._follow_load()
        while self._pending:
            self._settle(wait=True, deadline=deadline)

    def elastic_retry(
        self,
        *,
        max_retries: int | None = None,
        minimum_islands: int | None = None,
        timeout: float | None = None,
        on_elastic_event_callback: Callable[[], Any] | None = None,
        retry_policy: RetryPolicy | None = None,
    ) -> Callable[[_F], _F]:
        """Runs the decorated function again after a host loss the manager could not absorb.

        Shaped as ``pathwaysutils.elastic.Manager.elastic_retry``. The manager's
        state survives the failure: a loop written as ``for step in
        range(manager.step, total)`` goes on from the first step not taken.

        Args:
          max_retries: retries at most (``None``: as ``retry_policy`` says, else
            unlimited). Not with ``retry_policy``.
          minimum_islands: replicas to wait for before each retry (default:
            the manager's ``minimum_islands``).
          timeout: seconds to wait for them before each retry (``None``: no limit).
          on_elastic_event_callback: called after each failure, before waiting.
          retry_policy: ``(attempt, error) -> bool``: whether to retry.

        Raises:
          ValueError: both ``max_retries`` and ``retry_policy``, or a bad count.
        """
        if max_retries is not None and retry_policy is not None:
            raise ValueError("pass max_retries or retry_policy, not both.")
        if max_retries is not None:
            if not _is_int(max_retries) or max_retries < 1:
                raise ValueError(f"max_retries must be an int >= 1; got {max_retries!r}.")
            limit = max_retries
            retry_policy = lambda attempt, error: attempt <= limit  # noqa: E731
        policy: RetryPolicy = retry_policy or (lambda attempt, error: True)
        wanted = self.minimum_islands if minimum_islands is None else minimum_islands

        def decorator(function: _F) -> _F:
            @functools.wraps(function)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                attempt = 0
                while True:
                    try:
                        return function(*args, **kwargs)
                    except pw.errors.HostLostError as error:
                        attempt += 1
                        logging.warning("pw.elastic: attempt %d failed: %s", attempt, error)
                        if on_elastic_event_callback is not None:
                            on_elastic_event_callback()
                        if not policy(attempt, error):
                            raise
                        self._wait_for_islands(wanted, timeout)

            return wrapper  # type: ignore[return-value]

        return decorator

    # --- steps ------------------------------------------------------------------------------

    def _dispatch(self, step: _Step, keep: bool) -> None:
        """Runs ``step`` on the model's replicas as they are, from their current state (kept if ``keep``)."""
        model = self.model
        if keep:
            step.params, step.opt_states = list(model._params), list(model._opt_states)
        else:
            step.params = step.opt_states = None
        step.islands = self.islands
        step.complete = False
        if step.count is None:
            step.count = model._steps
        model._steps = step.count
        step.loss = model.train_step(step.x, step.y, **step.options)
        step.done_marks = tuple(jax.tree.leaves(p)[0] for p in model._params)

    def _settle(self, wait: bool, deadline: float | None = None) -> None:
        """Notes the steps known complete, oldest first (waiting for the oldest not known if ``wait``),
        and lets go of what no step may need to run again from."""
        if self._stalled:
            raise pw.errors.HostLostError(self._stalled_message())
        pending = self._pending
        for step in list(pending):
            if step.complete:
                continue
            if not wait and not (step.loss.done() and all(m.done() for m in step.done_marks)):
                break
            wait = False
            try:
                for future in (step.loss, *step.done_marks):
                    _block(future, deadline)
            except pw.errors.ProgramFailedError as error:
                self._recover(error)
                return
            step.complete = True
        # Steps run again from the latest kept state at or before the first step not known
        # complete; what comes before it goes. All complete: everything goes (the next step
        # dispatched keeps the state it starts from).
        first_open = next((i for i, step in enumerate(pending) if not step.complete), len(pending))
        restart = first_open
        if first_open < len(pending):
            restart = max(i for i in range(first_open + 1) if pending[i].params is not None)
        for _ in range(restart):
            pending.popleft()

    def _result(self, step: _Step, timeout: float | None) -> jax.Array:
        while True:
            loss = step.loss
            try:
                return loss.result(timeout)
            except pw.errors.FutureTimeoutError:
                raise
            except pw.errors.ProgramFailedError as error:
                if step not in self._pending:
                    raise
                if self._stalled:
                    raise pw.errors.HostLostError(self._stalled_message()) from error
                self._recover(error)
                if step.loss is loss:  # not run again: not a lost island's doing
                    raise

    def _recover(self, error: BaseException) -> None:
        """A pending step failed: if an island of a replica was lost, run the pending steps again without it."""
        start = time.monotonic()
        first = self._pending[0]  # it holds the state it started from (see _settle)
        keep = self._survivors(first)
        if len(keep) == len(first.islands) and _host_lost(error):
            # The run failed of a lost host before the cluster moved that island's slices.
            deadline = start + _LOSS_SEEN_S
            while len(keep) == len(first.islands) and time.monotonic() < deadline:
                time.sleep(_POLL_S)
                keep = self._survivors(first)
        slices = self.model.slices
        lost = sorted(pw.cluster().resources.lost)
        if len(keep) == len(slices):
            raise error  # no replica was lost: the step's own failure
        params, opt_states = first.params, first.opt_states
        if params is None or opt_states is None:  # _settle keeps the oldest step's state: never
            raise pw.errors.PathwaysError(
                f"pw.elastic: step {first.index} kept no state to run again from; this is a bug of "
                "pathways_jax: please report it."
            ) from error
        if not keep:
            raise pw.errors.HostLostError(
                f"pw.elastic: no replica survives the loss of islands {lost}: the state since step "
                f"{first.index} is gone. Restore it from a checkpoint."
            ) from error
        for i, slice_ in enumerate(slices):
            if i not in keep:
                slice_.release()
        self.model._set_replicas(
            [slices[i] for i in keep], [params[i] for i in keep], [opt_states[i] for i in keep]
        )
        if len(keep) < self.minimum_islands:
            # The survivors hold the state the open steps start from; they run again once
            # islands have come back (_rejoin), not on fewer replicas than asked.
            self._stalled = True
            self.events.append(Event(first.index, "lost", self.islands, time.monotonic() - start))
            raise pw.errors.HostLostError(self._stalled_message()) from error
        gone = sorted(set(first.islands) - set(self.islands))
        for index, step in enumerate(self._pending):  # in order: each from the state the one before leaves
            self._dispatch(step, keep=index == 0 or step.index % self.window == 0)
        self.events.append(Event(first.index, "lost", self.islands, time.monotonic() - start))
        logging.warning(
            "pw.elastic: the replicas of islands %s were lost; steps %d-%d run again on islands %s",
            gone,
            first.index,
            self._pending[-1].index,
            self.islands,
        )

    def _stalled_message(self) -> str:
        return (
            f"pw.elastic: {len(self.model.slices)} replicas are left (islands {list(self.islands)}), fewer "
            f"than minimum_islands={self.minimum_islands}: training waits for islands to come back from "
            f"step {self._pending[0].index if self._pending else self._step}, with the survivors' state. "
            "Call train_step again once they are (Manager.elastic_retry waits for them)."
        )

    def _survivors(self, step: _Step) -> list[int]:
        """The replicas whose state before ``step`` is still there.

        A replica survives if its slice is where the step found it, on an island
        not lost: a lost island's slices move (or stay on it, still lost), and
        its values went with its hosts.
        """
        lost = pw.cluster().resources.lost
        return [
            i
            for i, (slice_, island) in enumerate(zip(self.model.slices, step.islands, strict=True))
            if slice_.island == island and island not in lost
        ]

    # --- islands coming back ----------------------------------------------------------------

    def _rejoin(self) -> None:
        """At a step boundary: a replica for each home island that is up again and has none."""
        lost = pw.cluster().resources.lost
        if not [island for island in self._homes if island not in self.islands and island not in lost]:
            return
        start = time.monotonic()
        # The steps in flight complete first: every step kept to run again then has the
        # replicas it ran on, and the new one starts from a state known good. (Stalled, the
        # open steps have not run on these replicas: they run again once it has joined.)
        if not self._stalled:
            self.wait()
        here = set(self.islands)
        back = [island for island in self._homes if island not in here and island not in lost]
        model = self.model
        source_p, source_o = model._params[0], model._opt_states[0]
        replicas = dict(
            zip(self.islands, zip(model.slices, model._params, model._opt_states, strict=True), strict=True)
        )
        for island in back:
            try:
                slice_ = pw.devices(
                    mesh=self._mesh,
                    island=island,
                    exclusive=self._exclusive,
                    axis_types=self._axis_types,
                    timeout=0,
                )
            except pw.errors.ResourceError as exc:  # lost again, or taken: try at a later step
                logging.warning(
                    "pw.elastic: island %d is up but cannot take its replica yet: %s", island, exc
                )
                continue
            copy = pw.jit(
                lambda p, o: jax.tree.map(jnp.copy, (p, o)),
                devices=slice_,
                out_specs=(model._pspecs, model._ospecs),
            )
            replicas[island] = (slice_, *copy(source_p, source_o))
        if len(replicas) == len(here):
            return
        order = [island for island in self._homes if island in replicas]  # the model's first order
        model._set_replicas(*(list(part) for part in zip(*(replicas[i] for i in order), strict=True)))
        if self._stalled and len(order) >= self.minimum_islands:
            self._stalled = False
            for index, step in enumerate(self._pending):  # from the survivors' state, on every replica
                self._dispatch(step, keep=index == 0 or step.index % self.window == 0)
        self.events.append(Event(self._step, "rejoined", self.islands, time.monotonic() - start))
        logging.warning("pw.elastic: replicas on islands %s from step %d", self.islands, self._step)

    def _wait_for_islands(self, count: int, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        cluster = pw.cluster()
        while sum(1 for island in self._homes if island not in cluster.resources.lost) < count:
            if deadline is not None and time.monotonic() >= deadline:
                raise pw.errors.HostLostError(
                    f"pw.elastic: fewer than {count} of the replicas' islands {list(self._homes)} were up "
                    f"within {timeout}s."
                )
            time.sleep(_POLL_S)
        self._rejoin()

    # --- checks -----------------------------------------------------------------------------

    def _check_batch(self, x: Any) -> None:
        batch = stages_lib.batch_leaves(x, "x")[2]
        if batch in self._checked_batches:
            return
        counts = range(self.minimum_islands, len(self._homes) + 1)
        # Each replica's shard (batch / k examples, for every replica count k) is split again
        # over its slice's data axis.
        parts = math.lcm(*(stages_lib.data_parts(s, self.model.data_axis) for s in self.model.slices))
        need = math.lcm(*counts) * parts
        if not batch or batch % need:
            within = (
                f", and each shard over its slice's data axis {self.model.data_axis!r} ({parts} devices)"
                if parts > 1
                else ""
            )
            fewer = " (or raise minimum_islands)" if len(counts) > 1 else ""
            raise pw.errors.PlacementError(
                f"pw.elastic: the global batch has {batch} examples; it must split evenly over every "
                f"replica count training may have ({list(counts)}){within}, so use a multiple of {need}"
                f"{fewer}."
            )
        self._checked_batches.add(batch)

    def __repr__(self) -> str:
        return (
            f"pw.elastic.Manager(step={self._step}, islands={self.islands}, homes={self._homes}, "
            f"minimum_islands={self.minimum_islands})"
        )


def _block(future: Any, deadline: float | None) -> None:
    """Waits for ``future`` (raising as ``block_until_ready``), until ``deadline`` if one is given."""
    if deadline is not None:
        while not future.done():
            if time.monotonic() >= deadline:
                raise pw.errors.FutureTimeoutError(
                    f"pw.elastic: a step was not complete in time ({future!r})."
                )
            time.sleep(_POLL_S / 10)
    future.block_until_ready()


def _host_lost(error: BaseException | None) -> bool:
    """True if ``error`` or an error it was raised from is a ``HostLostError``."""
    seen = 0
    while error is not None and seen < 16:
        if isinstance(error, pw.errors.HostLostError):
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


__all__ = ["Event", "Loss", "Manager"]
