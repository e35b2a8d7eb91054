"""A Ray host's bound of executables in flight, without Ray: the host's own bookkeeping."""

import collections

import pytest

from pathways_jax._src.backends.ray_host import steps


class _Pending:
    """An executable's output: records when the host waits for it."""

    def __init__(self, log: list, index: int, fails: bool = False):
        self.log, self.index, self.fails = log, index, fails

    def block_until_ready(self):
        self.log.append(self.index)
        if self.fails:
            raise RuntimeError(f"output {self.index} failed")
        return self


@pytest.mark.parametrize("bound", [1, 2, 16, steps.PACE])
def test_a_host_keeps_at_most_its_bound_in_flight_and_waits_for_half_at_once(bound):
    in_flight, waited = collections.deque(), []
    peak, drains = 0, 0
    for i in range(10 * bound):
        before = len(waited)
        steps.pace(in_flight, _Pending(waited, i), bound)
        peak = max(peak, len(in_flight))
        drains += len(waited) > before
    assert peak <= bound
    # Waited for in the order they were made, each once, the newest never.
    assert waited == list(range(len(waited)))
    assert len(waited) >= 10 * bound - bound
    # Each wait takes half the window at once (a wait per executable before).
    assert drains <= 10 * bound // max(1, bound - bound // 2) + 1


def test_the_pace_stays_below_xla_s_own_bound_per_device():
    # XLA:CPU blocks the dispatching thread at 32 executions in flight per device.
    assert 2 <= steps.PACE < 32


def test_a_failed_output_of_an_earlier_run_does_not_fail_the_run_that_waits_for_it():
    in_flight, waited = collections.deque(), []
    bound = 4
    for i in range(bound):
        steps.pace(in_flight, _Pending(waited, i, fails=i == 0), bound)  # no exception
    assert waited == [0, 1]
    assert len(in_flight) == bound // 2


class _Device:
    def __init__(self, id: int, process_index: int):
        self.id, self.process_index = id, process_index


# Two hosts (processes 0 and 1) of two devices each: 0, 1 on host 0; 2, 3 on host 1.
_ISLAND = [_Device(0, 0), _Device(1, 0), _Device(2, 1), _Device(3, 1)]


@pytest.mark.parametrize(
    "ids, kind, mine",
    [
        ([1], steps.SINGLE, (1,)),
        ([1, 3], steps.LONE, (1,)),
        ([1, 0], steps.GANG, (0, 1)),
        ([0, 1, 2, 3], steps.CROSS_GANG, (0, 1)),
    ],
)
def test_an_executable_is_classed_by_its_devices_on_this_host_and_on_others(ids, kind, mine):
    assert steps.kind_of([_ISLAND[i] for i in ids], process=0) == (kind, mine)


def test_executables_spanning_hosts_wait_only_for_what_xla_does_not_order_before_them():
    waited: list = []
    order = steps.CrossHostOrder()
    order.after(steps.GANG, (0, 1), _Pending(waited, "gang"))
    order.after(steps.SINGLE, (0,), _Pending(waited, "single0-old"))
    order.after(steps.SINGLE, (0,), _Pending(waited, "single0"))  # after the old one on its device
    order.after(steps.SINGLE, (1,), _Pending(waited, "single1"))
    # Single-device and one-host gang executables never wait for another host: nothing to wait for.
    order.before(steps.SINGLE)
    order.before(steps.GANG)
    assert waited == []
    # A gang spanning hosts waits for the single-device ones (XLA orders it after the gang itself).
    order.before(steps.CROSS_GANG)
    assert sorted(waited) == ["single0", "single1"]
    order.before(steps.CROSS_GANG)  # each is waited for once
    assert len(waited) == 2
    # One device of this host spanning hosts: waits for everything launched before it, and
    # the next executable spanning hosts waits for it.
    order.after(steps.SINGLE, (1,), _Pending(waited, "single1-again"))
    order.before(steps.LONE)
    assert waited[2:] == ["gang", "single1-again"]
    order.after(steps.LONE, (1,), _Pending(waited, "lone", fails=True))
    order.before(steps.CROSS_GANG)  # its failure is its own run's, not this one's
    assert waited[4:] == ["lone"]
