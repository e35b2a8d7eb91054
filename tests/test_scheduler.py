"""Scheduling policies as pure code, and end to end through the controller."""

import collections

import jax.numpy as jnp
import pytest
from helpers import gated, wait_for

import pathways_jax as pw
from pathways_jax._src.runtime import scheduler
from pathways_jax._src.runtime.scheduler import Fair, Fifo, Head, Policy, Priority

# --- pure policies ------------------------------------------------------------------------


def _drive(policy, queues: dict, picks: int, cost=lambda c: 1.0, weights=None, priorities=None):
    """Runs ``picks`` choices over per-client queues of sequence numbers; returns the clients picked."""
    weights = weights or {}
    priorities = priorities or {}
    order = []
    for client in queues:
        policy.activate(client)
    for _ in range(picks):
        heads = [
            Head(c, q[0], priorities.get(c, 0), weights.get(c, 1.0), cost(c)) for c, q in queues.items() if q
        ]
        if not heads:
            break
        index = policy.pick(heads)
        policy.picked(heads, index)
        client = heads[index].client
        queues[client].popleft()
        order.append(client)
    return order


def test_fifo_is_global_submission_order():
    queues = {"a": collections.deque([0, 3, 4]), "b": collections.deque([1, 2, 5])}
    assert _drive(Fifo(), queues, 6) == ["a", "b", "b", "a", "a", "b"]


def test_priority_goes_first_and_is_fifo_within_a_level():
    queues = {
        "low": collections.deque([0, 1, 2]),
        "mid": collections.deque([3, 6]),
        "high": collections.deque([4, 5]),
        "mid2": collections.deque([7]),
    }
    order = _drive(
        Priority(starvation_limit=100), queues, 8, priorities={"low": 0, "mid": 1, "mid2": 1, "high": 2}
    )
    assert order == ["high", "high", "mid", "mid", "mid2", "low", "low", "low"]


def test_priority_bounds_starvation():
    limit = 3
    policy = Priority(starvation_limit=limit)
    queues = {"low": collections.deque(range(0, 10)), "high": collections.deque(range(100, 1000))}
    order = _drive(policy, queues, 60, priorities={"low": 0, "high": 10})
    lows = [i for i, c in enumerate(order) if c == "low"]
    assert len(lows) == 10
    # Passed over more than `limit` times: it goes next, so gaps are at most limit + 1.
    gaps = [b - a for a, b in zip([-1, *lows], lows, strict=False)]
    assert max(gaps) <= limit + 2, gaps
    # Without the bound the low client would wait for all high runs.
    unbounded = _drive(
        Priority(starvation_limit=10**9),
        {"low": collections.deque(range(0, 10)), "high": collections.deque(range(100, 1000))},
        60,
        priorities={"low": 0, "high": 10},
    )
    assert "low" not in unbounded


@pytest.mark.parametrize("weights", [{"a": 1, "b": 2, "c": 4, "d": 8}, {"a": 1.0, "b": 1.0}])
def test_fair_shares_follow_weights(weights):
    queues = {c: collections.deque(range(i * 10_000, (i + 1) * 10_000)) for i, c in enumerate(weights)}
    costs = {c: 0.5 + i for i, c in enumerate(weights)}  # unequal run costs: shares are of time
    order = _drive(Fair(), queues, 3000, cost=costs.get, weights=weights)
    time_of = collections.Counter()
    for c in order:
        time_of[c] += costs[c]
    total = sum(time_of.values())
    for c, w in weights.items():
        want = w / sum(weights.values())
        assert abs(time_of[c] / total - want) / want < 0.02, (c, time_of)


def test_fair_corrections_and_no_banked_credit():
    policy = Fair()
    policy.activate("a")
    policy.activate("b")
    # "a"'s estimate was too low: the measured time corrects its virtual time.
    policy.charge("a", 1.0, 1.0)
    policy.charge("a", 9.0, 1.0)  # correction: measured 10
    heads = [Head("a", 0, weight=1.0, cost=1.0), Head("b", 1, weight=1.0, cost=1.0)]
    assert heads[policy.pick(heads)].client == "b"
    # A client that was idle comes back at the active floor, not with its old credit.
    policy.deactivate("c")
    policy.vtime["c"] = 0.0
    policy.charge("b", 5.0, 1.0)
    policy.activate("c")
    assert policy.vtime["c"] == min(policy.vtime["a"], policy.vtime["b"])


def test_make_names_policies():
    assert isinstance(scheduler.make("fifo"), Fifo)
    assert scheduler.make("priority", starvation_limit=3).starvation_limit == 3
    assert isinstance(scheduler.make("fair"), Fair)
    with pytest.raises(ValueError, match="unknown scheduler"):
        scheduler.make("lottery")


@pytest.mark.parametrize("name", scheduler.POLICIES)
def test_every_policy_is_a_complete_policy(name):
    policy = scheduler.make(name)
    assert isinstance(policy, Policy)
    assert policy.name == name
    for method in ("pick", "picked", "activate", "deactivate", "charge", "discard", "forget"):
        assert callable(getattr(type(policy), method)), method


def test_an_incomplete_policy_is_not_a_policy():
    class PickOnly:
        name = "pick-only"

        def pick(self, heads):
            return 0

    assert not isinstance(PickOnly(), Policy)


def _kept(policy) -> dict:
    """The policy's per-client or per-run state that is not empty."""
    return {k: v for k, v in vars(policy).items() if isinstance(v, dict | set | list) and v}


@pytest.mark.parametrize("name", scheduler.POLICIES)
def test_policies_keep_nothing_once_clients_empty_and_close(name):
    # The controller's sequence of calls: queues fill, heads are picked or
    # cancelled, queues empty, clients close.
    policy = scheduler.make(name, starvation_limit=2)
    queues = {c: collections.deque(range(i * 100, i * 100 + 5)) for i, c in enumerate(range(40))}
    for client in queues:
        policy.activate(client)
        policy.charge(client, 0.5, 1.0)  # an inline dispatch before its queue filled
    picks = 0
    while any(queues.values()):
        heads = [Head(c, q[0], c % 3, 1.0 + c % 2, 1.0) for c, q in queues.items() if q]
        if picks % 7 == 3:  # a cancelled run (closed client, back-pressure timeout)
            head = heads[picks % len(heads)]
            queues[head.client].clear()
            policy.discard(head)
            policy.deactivate(head.client)
        else:
            index = policy.pick(heads)
            policy.picked(heads, index)
            queue = queues[heads[index].client]
            queue.popleft()
            if not queue:
                policy.deactivate(heads[index].client)
        picks += 1
    assert _kept(policy).keys() <= {"vtime"}  # a fair client's virtual time outlives an empty queue
    for client in queues:
        policy.forget(client)
    assert _kept(policy) == {}


def test_init_rejects_unknown_scheduler():
    with pytest.raises(pw.errors.ClusterError, match="scheduling policy"):
        pw.init(num_cpu_devices=8, islands=2, scheduler="lottery")


# --- end to end ---------------------------------------------------------------------------


def _plugged_order(policy: str, submit) -> list[str]:
    """Fills the island's window with a gated run, lets ``submit`` queue runs, returns their dispatch order."""
    pw.init(num_cpu_devices=8, islands=2, scheduler=policy, starvation_limit=100, max_in_flight=1)
    s = pw.devices(mesh={"x": 2}, island=0)
    held, gate, entered = gated(s, plus=1)
    work = pw.jit(lambda x: x * 2 + x.sum(), devices=s, in_specs=pw.P("x"))
    x = jnp.arange(4.0)
    gate.set()
    held(x).result(timeout=30)
    # Compiled, and its cost estimate past its first measurement (which the second replaces,
    # admission.fold): runs accounted together are one measurement, so each is waited for. Under
    # load the replacement came between "a"'s first pick, charged the first measurement (1.8 ms),
    # and "b"'s (0.09 ms each): every "b" run went before "a"'s second.
    accounting = pw.cluster().controller.accounting
    for _ in range(3):
        work(x).result(timeout=30)
        assert wait_for(accounting.idle, timeout=30)
    gate.clear()
    entered.clear()
    outs = []
    pw.start_trace()
    try:
        with pw.client("plug"):
            outs.append(held(x))  # in flight until the gate opens: fills the window of one
            assert entered.wait(30)
        # Every run submitted now waits in the queues for the window: the policy
        # alone orders them once the gate opens.
        outs += submit(work, x)
    finally:
        gate.set()
        trace = pw.stop_trace()
    for out in outs:
        out.result(timeout=30)
    s.release()
    dispatches = [
        e
        for e in trace["traceEvents"]
        if e.get("cat") == "dispatch" and e["ph"] == "X" and not e["name"].endswith("transfer")
    ]
    order = [e["args"]["client"] for e in sorted(dispatches, key=lambda e: e["ts"])]
    assert order[:1] == ["plug"]
    return order[1:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["fifo", "priority"])
def test_priority_end_to_end(policy):
    low = pw.client("low", priority=0)
    high = pw.client("high", priority=5)

    def submit(work, x):
        outs = []
        with low:
            outs += [work(x) for _ in range(3)]
        with high:
            outs += [work(x) for _ in range(3)]
        return outs

    order = _plugged_order(policy, submit)
    if policy == "priority":
        assert order == ["high"] * 3 + ["low"] * 3
    else:
        assert order == ["low"] * 3 + ["high"] * 3


@pytest.mark.timeout(120)
def test_fair_end_to_end_interleaves_by_weight():
    a = pw.client("a", weight=1.0)
    b = pw.client("b", weight=3.0)

    def submit(work, x):
        outs = []
        with a:
            outs += [work(x) for _ in range(12)]
        with b:
            outs += [work(x) for _ in range(12)]
        return outs

    order = _plugged_order("fair", submit)
    # While both have work queued, "b" gets about three runs for each of "a"'s
    # (estimates are corrected by measured device time, so not exactly 3:1).
    last_b = max(i for i, c in enumerate(order) if c == "b")
    assert 2 <= order[:last_b].count("a") <= 7, order
    assert sorted(order) == ["a"] * 12 + ["b"] * 12


@pytest.mark.timeout(120)
def test_fair_charges_the_cost_estimate_known_when_a_run_is_picked():
    a = pw.client("a", weight=2.0)
    seen = {}

    def submit(work, x):
        with a:
            outs = [work(x) for _ in range(4)]
        controller = pw.cluster().controller
        (queue,) = [q for key, q in controller._queues.items() if key == a.key]
        assert len(queue) == 4  # the controller is plugged: nothing of "a" was picked yet
        seen["queued_with"] = queue[0].head.cost
        controller.accounting.costs[queue[0].plan.key] = (
            100.0  # the estimate moves while the runs wait (far above any measure)
        )
        seen["vtime"] = controller._policy.vtime[a.key]
        seen["controller"] = controller
        return outs

    order = _plugged_order("fair", submit)
    assert order == ["a"] * 4
    charged = seen["controller"]._policy.vtime[a.key] - seen["vtime"]
    # Each pick charges cost / weight with the estimate of that moment: 100 s for the first, then
    # the estimate as measured runs pull it down (an EMA of weight 0.1), so above 50 s in all.
    # Charging the estimate the runs were queued with would give 4 * queued_with / 2.
    assert seen["queued_with"] < 1.0
    assert charged >= 50.0, charged


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", scheduler.POLICIES)
def test_closed_clients_leave_no_state_in_the_policy(policy):
    pw.init(num_cpu_devices=8, islands=2, scheduler=policy, starvation_limit=100, max_in_flight=1)
    s = pw.devices(mesh={"x": 2}, island=0)
    held, gate, entered = gated(s, plus=1)
    work = pw.jit(lambda x: x * 2 + x.sum(), devices=s, in_specs=pw.P("x"))
    x = jnp.arange(4.0)
    plug = pw.client("plug")
    with plug:
        gate.set()
        held(x).result(timeout=30)  # inline: charged to "plug"
        work(x).result(timeout=30)
        gate.clear()
        entered.clear()
        plugged = [held(x)]  # in flight until the gate opens: fills the window of one
        assert entered.wait(30)
    controller = pw.cluster().controller
    clients = [pw.client(f"c{i}", priority=i % 3, weight=1.0 + i % 2) for i in range(12)]
    outs = {}
    for c in clients:
        with c:
            outs[c] = [work(x) for _ in range(3)]
    assert len(controller._queues) == len(clients)  # all queued behind the plug
    if policy == "fair":
        assert _kept(controller._policy)  # the test looks at state that exists
    for c in clients[::2]:
        c.close()  # cancels its queued runs
    gate.set()
    for c in clients[1::2]:
        for out in outs[c]:
            out.result(timeout=30)
    for out in plugged:
        out.result(timeout=30)
    for c in [*clients[1::2], plug]:
        c.close()
    s.release()
    with controller._lock:
        assert controller._queues == {}
        assert _kept(controller._policy) == {}
