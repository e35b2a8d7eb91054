"""Failures on purpose, to rehearse them: ``pw.faults.kill_host(1, at_run=1)``.

A Ray host told to fail does it to itself, so the controller meets what a
lost machine (``kill_host``: SIGKILL) or a wedged process (``hang_host``:
SIGSTOP) looks like, at the step you chose.
"""

from pathways_jax._src.api.faults import hang_host as hang_host
from pathways_jax._src.api.faults import kill_host as kill_host

__all__ = ["hang_host", "kill_host"]
