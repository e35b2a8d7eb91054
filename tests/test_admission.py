"""The admission core (runtime/admission.py): one clock-free core the controller, the service and the
simulator share. Driven directly, with no threads and no clock."""

from __future__ import annotations

import ast
import pathlib

import pytest

from pathways_jax._src.runtime import admission, scheduler
from pathways_jax._src.runtime.scheduler import Head

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "pathways_jax"


class Recording:
    """A policy that records what it is told, and picks the oldest head."""

    name = "recording"
    charges = False

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def pick(self, heads):
        return min(range(len(heads)), key=lambda i: heads[i].seq)

    def picked(self, heads, index):
        self.calls.append(("picked", heads[index].client, heads[index].seq))

    def activate(self, client):
        self.calls.append(("activate", client))

    def deactivate(self, client):
        self.calls.append(("deactivate", client))

    def charge(self, client, seconds, weight):
        self.calls.append(("charge", client))

    def discard(self, head):
        self.calls.append(("discard", head.client, head.seq))

    def forget(self, client):
        self.calls.append(("forget", client))


def test_queues_keep_each_clients_order_and_tell_the_policy_when_queues_fill_and_empty():
    policy = Recording()
    queues: admission.Queues[str, int] = admission.Queues(policy)
    assert not queues and len(queues) == 0
    for client, item in [("a", 0), ("b", 1), ("a", 2), ("a", 3)]:
        queues.push(client, item)
    assert policy.calls == [("activate", "a"), ("activate", "b")]  # once per queue that fills
    assert queues.heads() == [("a", 0), ("b", 1)] and len(queues) == 4 and queues.queued("a") == 3
    order = []
    while queues:
        heads = [Head(c, item) for c, item in queues.heads()]
        client = heads[queues.pick(heads)].client
        order.append(queues.pop(client))
    assert order == [0, 1, 2, 3]
    assert ("deactivate", "b") in policy.calls and policy.calls[-1] == ("deactivate", "a")
    assert queues.queues == {}


def test_a_refused_choice_stays_queued_and_uncharged():
    policy = scheduler.Fair()
    queues: admission.Queues[str, int] = admission.Queues(policy)
    queues.push("a", 0)
    heads = [Head("a", 0, cost=1.0)]
    index = queues.choose(heads)
    assert index == 0 and policy.vtime["a"] == 0.0  # not charged until picked
    assert queues.heads() == [("a", 0)]
    queues.picked(heads, index)
    assert policy.vtime["a"] == 1.0


def test_drop_close_and_retire_leave_no_policy_state():
    policy = scheduler.Priority(starvation_limit=100)
    queues: admission.Queues[str, int] = admission.Queues(policy)
    for seq in range(3):
        queues.push("low", seq)
    queues.push("high", 10)
    heads = [Head("low", 0, priority=0), Head("high", 10, priority=5)]
    assert heads[queues.pick(heads)].client == "high"
    queues.pop("high")
    assert policy.passed == {0: 1}  # the low head was passed over once
    assert queues.drop("low", Head("low", 0)) == 0
    assert policy.passed == {}
    assert queues.close("low", lambda seq: Head("low", seq)) == [1, 2]
    assert queues.queues == {} and policy.passed == {}

    fair = scheduler.Fair()
    queues = admission.Queues(fair)
    queues.push("a", 0)
    queues.retire("a")  # still has a run queued: forgotten after it
    assert "a" in fair.vtime
    queues.pop("a")
    assert "a" not in fair.vtime and queues.retiring == set()
    queues.retire("b")  # nothing queued: forgotten at once
    assert queues.retiring == set()


def test_an_interrupted_push_leaves_an_empty_queue_that_is_forgotten():
    policy = Recording()
    queues: admission.Queues[str, int] = admission.Queues(policy)
    queues.push("a", 0)
    queues.queues["a"].clear()
    queues.remove_empty("a")
    assert queues.queues == {} and policy.calls[-1] == ("deactivate", "a")


@pytest.mark.parametrize(
    ("running", "count", "window", "room"),
    [(0, 1, 4, True), (3, 1, 4, True), (4, 1, 4, False), (2, 2, 4, True), (3, 2, 4, False),
     # a run larger than half the window counts as half of it: it never waits forever
     (0, 9, 4, True), (2, 9, 4, True), (3, 9, 4, False), (0, 5, 1, True), (1, 5, 1, False)],
)  # fmt: skip
def test_window_room(running, count, window, room):
    assert admission.has_room(running, count, window) is room


def test_the_back_pressure_verdict_uses_only_the_times_it_is_given():
    assert not admission.waited_too_long(None, 100.0, 1.0)  # not waiting
    assert not admission.waited_too_long(10.0, 100.0, None)  # no timeout
    assert not admission.waited_too_long(10.0, 10.5, 1.0)
    assert admission.waited_too_long(10.0, 11.0, 1.0)


def test_one_smoothed_estimate():
    assert admission.smoothed(0.0, 2.0) == 2.0  # the first measurement is the estimate
    w = admission.ESTIMATE_WEIGHT
    assert admission.smoothed(1.0, 2.0) == pytest.approx((1 - w) * 1.0 + w * 2.0)
    estimate = 0.0
    for _ in range(200):
        estimate = admission.smoothed(estimate, 5.0)
    assert estimate == pytest.approx(5.0)


def test_a_programs_second_measurement_replaces_its_first_and_later_ones_are_smoothed():
    estimates: dict[str, float] = {}
    once: set[str] = set()
    admission.fold(estimates, once, "step", 2.7e-3)  # the first run: one-time work included
    assert estimates == {"step": 2.7e-3} and once == {"step"}
    admission.fold(estimates, once, "step", 1.0e-4)  # the second replaces it
    assert estimates == {"step": 1.0e-4} and not once
    admission.fold(estimates, once, "step", 2.0e-4)  # then smoothed, as the one rule says
    assert estimates["step"] == pytest.approx(admission.smoothed(1.0e-4, 2.0e-4))
    admission.fold(estimates, once, "other", 5.0)  # each program on its own
    assert estimates["step"] == pytest.approx(admission.smoothed(1.0e-4, 2.0e-4)) and once == {"other"}


def test_whether_a_programs_runs_are_short_is_the_median_of_its_latest_measurements():
    medians: dict[str, float] = {}
    recent: dict = {}
    admission.fold_median(medians, recent, "step", 2.7e-3)  # the first run: one-time work included
    assert medians == {"step": 2.7e-3}
    admission.fold_median(medians, recent, "step", 1.0e-4)
    admission.fold_median(medians, recent, "step", 1.2e-4)
    assert medians["step"] == 1.2e-4  # the first run's figure is outvoted at once
    admission.fold_median(medians, recent, "step", 4.0e-3)  # a look that waited for the GIL
    admission.fold_median(medians, recent, "step", 1.0e-6)  # and the look right after it
    assert medians["step"] == 1.2e-4
    admission.fold_median(medians, recent, "other", 5.0)  # each program on its own
    assert medians["other"] == 5.0
    for _ in range(admission.MEDIAN_KEPT // 2 + 1):  # a program whose runs became long: followed
        admission.fold_median(medians, recent, "step", 2.0e-3)
    assert medians["step"] == 2.0e-3
    assert len(recent["step"]) == admission.MEDIAN_KEPT


def test_the_controller_and_the_service_fold_their_measurements_by_the_one_rule():
    for path in (PACKAGE / "_src/runtime/accounting.py", PACKAGE / "_src/runtime/serving/actor.py"):
        text = path.read_text()
        assert "fold(" in text and "smoothed(" not in text, f"{path} estimates device time by its own rule"


def test_the_budget_reserves_holds_releases_and_tells_listeners():
    budget = admission.Budget({0: 100, 1: 50})
    told = []
    budget.listeners.append(lambda: told.append(dict(budget.used)))
    with budget.lock:
        assert budget.try_reserve(((0, 60), (1, 50)))
        assert not budget.try_reserve(((0, 60),))
    assert budget.used == {0: 60, 1: 50}
    assert budget.exceeds(((0, 101),)) and not budget.exceeds(((0, 100),))
    budget.hold(((0, 10),))  # committed whatever the limit
    budget.release(((0, 70), (1, 50)))
    assert budget.used == {0: 0, 1: 0} and told == [{0: 0, 1: 0}]
    budget.release(((0, 1),), locked=True)  # under the caller's lock: nobody told
    assert len(told) == 1


def _calls(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }


def test_no_module_but_the_core_keeps_queues_for_a_policy():
    """The controller, the service and the simulator admit through the core: none of them tells a
    policy that a queue filled or emptied itself (they re-implemented it, with drifting rules)."""
    users = {
        "controller": PACKAGE / "_src/runtime/controller.py",
        "service": PACKAGE / "_src/runtime/serving/gate.py",
        "simulator": PACKAGE / "sim/_engine.py",
    }
    for name, path in users.items():
        text = path.read_text()
        assert "admission.Queues(" in text, f"the {name} does not use the admission core"
        called = _calls(path)
        assert not called & {"activate", "deactivate"}, f"the {name} tells a policy about queues itself"
    for path in PACKAGE.rglob("*.py"):
        if path.name in ("admission.py", "scheduler.py"):
            continue
        assert not _calls(path) & {"activate", "deactivate"}, f"{path} keeps queues for a policy itself"
