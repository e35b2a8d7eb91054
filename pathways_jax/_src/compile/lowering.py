"""Lowering: a graph and a placement become a frozen Plan.

A Plan is what the controller runs: slots for values, host feeds, moves
between slices, and compiled executables, all decided once per placement
(``binding`` lays them out; ``steps`` holds their records).
"""

from __future__ import annotations

import collections
import collections.abc
import copy
import dataclasses
import itertools
import operator
from typing import TYPE_CHECKING, Any

import jax

from pathways_jax._src.compile import binding, lowering_log
from pathways_jax._src.compile.node_compiler import calls_host
from pathways_jax._src.compile.placement import NOWHERE, Placement
from pathways_jax._src.compile.steps import AccountingGroup, ExecStep
from pathways_jax._src.core import charges as charges_lib
from pathways_jax._src.core import counts, errors, events
from pathways_jax._src.core.charges import Charge
from pathways_jax._src.ir.graph import Graph
from pathways_jax._src.ir.signatures import ScalarKey

if TYPE_CHECKING:
    from pathways_jax._src.ir.signatures import Signature

_plans = itertools.count()


@dataclasses.dataclass(frozen=True, slots=True)
class Prepared:
    """What a backend adds to a compiled plan: ``Backend.prepare``'s answer.

    Attributes:
      windowed: executables (or host messages) a run puts in each window: its
        key is an island, or a device's window (``backends.base.device_window_key``).
      islands: the islands a run's work goes to.
      reports: dispatch reports a run makes to a trace.
      part: the backend's own part of the plan (the local backend's lanes,
        the Ray hosts' parts), read by that backend alone.
    """

    windowed: collections.abc.Mapping[int, int]
    islands: frozenset[int] = frozenset()
    reports: int = 0
    part: Any = None


class Plan:
    """A graph bound to physical devices: what the controller executes per run.

    Frozen once compiled: nothing sets an attribute of a plan after its
    construction. Its backend's part comes as a copy (:meth:`with_prepared`).
    It is plain data: it holds no cluster, backend or runtime slice. The
    runtime keeps those beside it (``runtime.runnable.Runnable``), with the
    check that says whether its placement still holds.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise dataclasses.FrozenInstanceError(
                f"a Plan is frozen once compiled; cannot set {name!r} (a backend's part goes in "
                "Plan.with_prepared)"
            )
        object.__setattr__(self, name, value)

    def __init__(
        self,
        graph: Graph,
        signature: Signature,
        placement: Placement = NOWHERE,
        donated: frozenset[int] = frozenset(),
    ):
        self.graph = graph
        self.key = next(_plans)  # never reused, unlike id(): accounting keys its figures by it
        self.donated_args = donated  # argument leaves the caller donated (donate_argnums)
        # Where the graph's slices are and what runs them: all lowering reads of the runtime.
        self.placement = placement
        target = placement.target
        bound = binding.bind(graph, signature, placement, donated)
        self.template: list[Any] = bound.template  # a run's slots: None, or a constant on devices
        self.host_feeds = bound.host_feeds  # (arg index, slot, sharding)
        # Python int leaves no executable reads (returned as they are, or unused): a call checks
        # them against JAX's integer type as jax.jit does (host feeds are checked as they go).
        fed = {index for index, _, _ in self.host_feeds}
        self.unfed_ints = tuple(
            index
            for index, key in enumerate(signature)
            if type(key) is ScalarKey and key.python_type is int and index not in fed
        )
        self.input_charges = bound.input_charges  # bytes of each host feed on its devices
        self.array_feeds = bound.array_feeds  # (arg index, slot): taken as is
        self.future_feeds = bound.future_feeds  # (arg index, slot)
        # The same as two tuples: a run reads its futures by these (see runs.Run.feeds).
        self.future_indices = tuple(index for index, _ in self.future_feeds)
        self.future_slots = tuple(slot for _, slot in self.future_feeds)
        self.feed_shardings = bound.feed_shardings  # slot -> sharding of the future fed there
        self.steps = bound.steps
        self.outputs = bound.outputs
        # Static bytes of what each step makes, by slot: reserved under a memory budget.
        self.slot_charge = bound.slot_charge
        self.step_charge = bound.step_charge  # (what, bytes per device) per step
        # Feed slots whose buffer an executable consumes: the futures fed there are spent
        # (array feeds too: a call with futures may run the plan of arrays, Program._array_plan).
        self.consumed_feeds = frozenset(
            slot for _, slot in (*self.future_feeds, *self.array_feeds) if slot in bound.consumed
        )
        self._account()
        if self.consumed_feeds and target is not None and not target.donates:
            self.consumed_feeds = frozenset()  # compiled without donation there
        if placement.limits is not None:
            self.check_budget(placement.limits)
        # Under a budget, a queued run holds its host inputs on the host: the
        # controller puts them on devices when it admits the run.
        self.staged_feeds = (
            placement.limits is not None
            and target is not None
            and target.stages_inputs
            and bool(self.host_feeds)
        )
        # A backend that does not stage inputs ships them with the run's message.
        self.shipped_feeds = target is not None and not target.stages_inputs
        self.signatures = [out.signature for out in self.outputs]
        # Outputs submission makes ready itself (literals, arguments returned as they are).
        self.special_outputs = [(i, out) for i, out in enumerate(self.outputs) if out.kind != "slot"]
        self.slot_outputs = {out.where: out for out in self.outputs if out.kind == "slot"}
        # (output position, slot) of each output a node makes: what a dispatched run publishes;
        # those it publishes as copies of the slot's array (OutputSlot.fresh) apart.
        self.published = tuple(
            (i, out.where) for i, out in enumerate(self.outputs) if out.kind == "slot" and not out.fresh
        )
        self.published_copies = tuple(
            (i, out.where) for i, out in enumerate(self.outputs) if out.kind == "slot" and out.fresh
        )
        # The outputs of a run in position order, read from its slots in one C call
        # (``Controller._publish`` of a batch): where every output is a slot published as it is.
        # (None: fewer than two outputs, or some made otherwise; see Controller._publish.)
        self.outputs_of: operator.itemgetter[Any] | None = None
        if len(self.outputs) > 1 and len(self.published) == len(self.outputs):
            self.outputs_of = operator.itemgetter(*(slot for _, slot in self.published))
        # How many windowed executables the plan puts on each island: a run
        # may be dispatched on the caller's thread only if they all fit now.
        # XLA's CPU client runs executables that call back into Python on the
        # dispatching thread; such runs always go through the controller's
        # thread so that the caller never waits for them.
        self.inline_ok = not any(
            isinstance(step, ExecStep) and calls_host(step.node.jaxpr.jaxpr) for step in self.steps
        )
        self.windowed: dict[int, int] = collections.Counter(
            step.island for step in self.steps if isinstance(step, ExecStep) and step.windowed
        )
        # Until its backend prepares it (a plan that places nothing never is): no part of a backend's.
        self.prepared = Prepared(self.windowed, self.islands)
        self._frozen = True

    def with_prepared(self, prepared: Prepared) -> Plan:
        """This plan with its backend's part: a copy holding ``prepared`` (this one is unchanged)."""
        plan = copy.copy(self)
        object.__setattr__(plan, "prepared", prepared)
        return plan

    def _account(self) -> None:
        """Byte counts, accounting groups and islands of the plan (after ``_lower``)."""
        total: dict[int, int] = {}
        for charge in self.slot_charge.values():
            charges_lib.add(total, charge)
        seen: set[int] = set()
        out_charges: list[Charge | None] = []
        for out in self.outputs:
            if out.kind == "slot" and out.fresh:
                # A buffer of its own (an argument returned as it is, a value returned twice):
                # its bytes are the run's too, beyond its slots'.
                charge = charges_lib.charge_of(out.aval, out.sharding)
                charges_lib.add(total, charge)
                out_charges.append(charge)
            elif out.kind == "slot" and out.where in self.slot_charge and out.where not in seen:
                seen.add(out.where)
                out_charges.append(self.slot_charge[out.where])
            else:
                out_charges.append(None)
        self.out_charges = out_charges
        self.charge: Charge = tuple(sorted((d, b) for d, b in total.items() if b))
        # Under a memory budget a run also holds its host inputs once on devices:
        # they are put there only when the run is admitted, and count until it completes.
        for charge in self.input_charges:
            charges_lib.add(total, charge)
        self.admit_charge: Charge = tuple(sorted((d, b) for d, b in total.items() if b))
        # Accounting: per set of devices, the slot of the last node there and
        # how many nodes ran there; the watcher times the run by their readiness.
        groups: dict[tuple[int, ...], AccountingGroup] = {}
        islands: set[int] = set()
        for step in self.steps:
            if isinstance(step, ExecStep):
                islands.add(step.island)
                # A float0 output (a gradient of an integer input) is host data with no readiness.
                timed = [
                    slot
                    for slot, aval in zip(step.out_slots, step.node.jaxpr.out_avals, strict=True)
                    if aval.dtype != jax.dtypes.float0
                ]
                if not timed:
                    continue
                key = tuple(sorted(self.placement.device_ids(step.node.slice.id)))
                count = groups[key].node_count + 1 if key in groups else 1
                groups[key] = AccountingGroup(key, timed[0], count)
        self.acct_groups = tuple(groups.values())
        self.devices = frozenset(d for key in groups for d in key)
        self.islands = frozenset(islands)

    def check_budget(self, limits: collections.abc.Mapping[int, int]) -> None:
        """Raises ``ResourceError`` if this plan's outputs can never fit a budget of ``limits`` (bytes by device id)."""
        for what, charge in self.step_charge:
            for d, b in charge:
                if b > limits.get(d, b):
                    raise errors.ResourceError(
                        f"program {self.graph.name!r}: the outputs of {what} need {b} bytes on "
                        f"device {d}, but its memory budget is {limits[d]} bytes; it can never "
                        "run. Shard the value over more devices, make it smaller, or raise "
                        "pw.init(memory_budget=...)."
                    )
        for d, b in self.admit_charge:
            if b > limits.get(d, b):
                raise errors.ResourceError(
                    f"program {self.graph.name!r} ({self.graph.source_info}): its nodes' outputs "
                    f"and host inputs together need {b} bytes on device {d}, but its memory budget is "
                    f"{limits[d]} bytes; a run can never be admitted. Split the program, or raise "
                    "pw.init(memory_budget=...)."
                )


def lower(
    graph: Graph, signature: Signature, placement: Placement, donated: frozenset[int] = frozenset()
) -> Plan:
    """Binds ``graph`` to the devices ``placement`` gives its slices and compiles its nodes.

    ``donated``: argument leaves whose buffers the program may consume.
    """
    t0 = events.now()
    plan = Plan(graph, signature, placement, donated)
    counts.bump("lowerings")
    lowering_log.lowered(graph, placement, t0)
    return plan


__all__ = ["Plan", "Prepared", "lower"]
