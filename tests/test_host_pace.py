"""A Ray host's bound of executables in flight, without Ray: the host's own bookkeeping."""

import collections

import pytest

from pathways_jax._src.backends import ray_host


class _Pending:
    """An executable's output: records when the host waits for it."""

    def __init__(self, log: list, index: int, fails: bool = False):
        self.log, self.index, self.fails = log, index, fails

    def block_until_ready(self):
        self.log.append(self.index)
        if self.fails:
            raise RuntimeError(f"output {self.index} failed")
        return self


class _HostState:
    def __init__(self):
        self._in_flight = collections.deque()


@pytest.mark.parametrize("bound", [1, 2, 16, ray_host.PACE])
def test_a_host_keeps_at_most_its_bound_in_flight_and_waits_for_half_at_once(bound):
    host, waited = _HostState(), []
    peak, drains = 0, 0
    for i in range(10 * bound):
        before = len(waited)
        ray_host.Host._pace(host, _Pending(waited, i), bound)
        peak = max(peak, len(host._in_flight))
        drains += len(waited) > before
    assert peak <= bound
    # Waited for in the order they were made, each once, the newest never.
    assert waited == list(range(len(waited)))
    assert len(waited) >= 10 * bound - bound
    # Each wait takes half the window at once (a wait per executable before).
    assert drains <= 10 * bound // max(1, bound - bound // 2) + 1


def test_the_pace_stays_below_xla_s_own_bound_per_device():
    # XLA:CPU blocks the dispatching thread at 32 executions in flight per device.
    assert 2 <= ray_host.PACE < 32


def test_a_failed_output_of_an_earlier_run_does_not_fail_the_run_that_waits_for_it():
    host, waited = _HostState(), []
    bound = 4
    for i in range(bound):
        ray_host.Host._pace(host, _Pending(waited, i, fails=i == 0), bound)  # no exception
    assert waited == [0, 1]
    assert len(host._in_flight) == bound // 2
