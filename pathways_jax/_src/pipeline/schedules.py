"""Pipeline schedules: the order in which a train step calls its stage nodes.

The controller dispatches a program's nodes in the order the traced function
calls them, and every island runs its share in that order. A schedule is
therefore just a list of operations:

- ``("F", s, m)``: forward of stage ``s`` on microbatch ``m``;
- ``("L", s, m)``: the last stage: forward, loss and backward in one node;
- ``("B", s, m)``: backward of stage ``s`` on microbatch ``m``.
"""

from __future__ import annotations

from typing import Literal

import pathways_jax as pw

Schedule = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")
Op = tuple[str, int, int]


def _check(schedule: str | None, num_stages: object, num_microbatches: object, what: str) -> None:
    """Raises ``PlacementError`` unless the schedule is known and both counts are ints >= 1."""
    if schedule is not None and schedule not in SCHEDULES:
        raise pw.errors.PlacementError(f"{what}: schedule must be one of {SCHEDULES}, got {schedule!r}.")
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise pw.errors.PlacementError(
                f"{what}: {name} must be an int >= 1, got {type(value).__name__} {value!r}; e.g. {name}=4."
            )


def _stage_ops(schedule: Schedule, stage: int, num_stages: int, num_microbatches: int) -> list[Op]:
    m_all = range(num_microbatches)
    if stage == num_stages - 1:
        return [("L", stage, m) for m in m_all]
    if schedule == "gpipe":
        return [("F", stage, m) for m in m_all] + [("B", stage, m) for m in m_all]
    warmup = min(num_stages - 1 - stage, num_microbatches)
    ops: list[Op] = [("F", stage, m) for m in range(warmup)]
    for m in range(num_microbatches - warmup):
        ops += [("F", stage, warmup + m), ("B", stage, m)]
    ops += [("B", stage, m) for m in range(num_microbatches - warmup, num_microbatches)]
    return ops


def _deps(op: Op, num_stages: int) -> list[Op]:
    kind, s, m = op
    last = num_stages - 1
    if kind in ("F", "L"):
        return [("F", s - 1, m)] if s > 0 else []
    return [("F", s, m), ("L", s + 1, m) if s + 1 == last else ("B", s + 1, m)]


def schedule_order(schedule: Schedule, num_stages: int, num_microbatches: int) -> tuple[Op, ...]:
    """The global order of a train step's stage operations.

    Each stage runs its own list (GPipe: all forwards, then all backwards;
    1F1B: ``num_stages - 1 - s`` warm-up forwards, then one forward and one
    backward in turn, then the remaining backwards). The lists are merged
    by simulating unit time steps: in each step every stage whose next
    operation has its inputs from earlier steps runs it.

    Args:
      schedule: ``"gpipe"`` or ``"1f1b"``.
      num_stages: stages of the model.
      num_microbatches: microbatches of a step.

    Returns:
      A tuple of ``(kind, stage, microbatch)``, kind ``"F"``, ``"L"`` or ``"B"``.

    Raises:
      PlacementError: an unknown schedule, or a count that is not an int >= 1.

    Example:
      >>> from pathways_jax.pipeline import schedule_order
      >>> schedule_order("1f1b", 2, 2)
      (('F', 0, 0), ('L', 1, 0), ('F', 0, 1), ('L', 1, 1), ('B', 0, 0), ('B', 0, 1))
    """
    _check(schedule, num_stages, num_microbatches, "schedule_order")
    per_stage = [_stage_ops(schedule, s, num_stages, num_microbatches) for s in range(num_stages)]
    done: set[Op] = set()
    order: list[Op] = []
    while any(per_stage):
        # Later stages first within a step: their work frees activations sooner.
        ready = [
            ops[0] for ops in reversed(per_stage) if ops and all(d in done for d in _deps(ops[0], num_stages))
        ]
        if not ready:  # pragma: no cover - the lists above always make progress
            raise AssertionError(f"schedule {schedule!r} is stuck at {[ops[:1] for ops in per_stage]}")
        for op in ready:
            per_stage[op[1]].pop(0)
        order += ready
        done.update(ready)
    return tuple(order)


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """The idle fraction of a synchronous pipeline step: ``(S - 1) / (M + S - 1)``.

    GPipe and 1F1B have the same bubble (1F1B saves activation memory, not
    time): each stage idles while the first microbatch fills the pipeline
    and the last one drains it.

    Raises:
      PlacementError: a count that is not an int >= 1.

    Example:
      >>> from pathways_jax.pipeline import bubble_fraction
      >>> bubble_fraction(4, 12)
      0.2
    """
    _check(None, num_stages, num_microbatches, "bubble_fraction")
    return (num_stages - 1) / (num_microbatches + num_stages - 1)
