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
