"""A plan's records: the steps a run takes, where each output comes from, and accounting groups."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple

import jax

from pathways_jax._src.ir.graph import Node, SliceRef
from pathways_jax._src.ir.signatures import FutureKey


@dataclasses.dataclass(frozen=True, slots=True)
class MoveStep:
    """Copy ``src`` to ``dst`` with ``sharding``: a transfer between slices, or a reshard."""

    src: int
    dst: int
    sharding: jax.sharding.Sharding
    kind: Literal["ici", "dcn"] | None
    aval: Any  # the moved value's shape and dtype (backends moving it between hosts need them)


@dataclasses.dataclass(frozen=True, slots=True)
class ExecStep:
    """Dispatch one compiled node."""

    executable: Any
    in_slots: tuple[int, ...]
    out_slots: tuple[int, ...]
    node: Node
    island: int
    pinned: tuple[tuple[int, jax.Device], ...] = ()
    # Executables over several devices may hold collectives, and ones that call
    # back into Python hold a host thread each: they count against the island's
    # in-flight bound. Other single-device ones neither rendezvous nor block.
    windowed: bool = True
    # (serialized jax.export bytes, fingerprint) for remote hosts; None locally.
    exported: tuple[bytes, str] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class OutputSlot:
    """Where a program output comes from: a slot, a host argument, or a literal."""

    kind: Literal["slot", "argument", "literal"]
    where: Any
    aval: Any
    sharding: Any
    slice: SliceRef | None
    origin: str
    committed: bool = True  # False: an uncommitted one-device output, as jax.jit's (Graph.uncommitted_slice)
    # A run hands out a copy of the slot's array, as jax.jit gives every output a buffer of its
    # own: the slot holds an argument returned as it is, or another output's value.
    fresh: bool = False

    @property
    def signature(self) -> FutureKey | None:
        """The argument cache key of futures made from this output (None: compute later)."""
        if self.sharding is None:
            return None
        return FutureKey.of(self.aval, self.sharding, self.slice, self.committed)


class AccountingGroup(NamedTuple):
    """The nodes of a plan on one set of devices: the accounting watcher times a run by them.

    A run's work on ``devices`` is done when the output in ``slot`` (of the
    last of those nodes) is ready; its ``node_count`` nodes there share that time.
    """

    devices: tuple[int, ...]  # device ids, sorted
    slot: int
    node_count: int


__all__ = ["AccountingGroup", "ExecStep", "MoveStep", "OutputSlot"]
