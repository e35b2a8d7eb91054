"""Ray backend and controller service as a team sharing a cluster meets them: a controller process
that stops a while (Ctrl-Z, a debugger, a starved machine) and goes on.

Client processes are subprocesses joining the module's shared local Ray
cluster by address; results are compared with plain ``jax.jit``.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import wait_for

pytestmark = pytest.mark.timeout(180)

HUNG_S = 1.0  # the subprocess's PATHWAYS_JAX_HUNG_S: a host silent this long is hung

PAUSED = textwrap.dedent(
    """
    import pathlib, sys, time
    import jax, jax.numpy as jnp, numpy as np
    import pathways_jax as pw

    folder = pathlib.Path(sys.argv[2])
    pw.init(backend="ray", address=sys.argv[1], hosts=1)
    f = pw.jit(lambda v: jnp.cos(v) + 1, devices=pw.devices(mesh={"x": 1}))
    x = jnp.arange(4.0)
    want = np.asarray(jax.jit(lambda v: jnp.cos(v) + 1)(x))
    np.testing.assert_array_equal(np.asarray(f(x).result(timeout=60)), want)
    (folder / "ready").touch()
    while not (folder / "resumed").exists():
        time.sleep(0.01)
    np.testing.assert_array_equal(np.asarray(f(x).result(timeout=60)), want)
    print("after the pause: result matches jax.jit", flush=True)
    pw.shutdown()
    """
)


def test_a_controller_stopped_a_while_keeps_its_hosts(ray_cluster, tmp_path: pathlib.Path):
    # A script on Ray hosts stopped (Ctrl-Z, then fg) for longer than the hung-host bound: on its
    # return its monitor found every host silent for that long (their heartbeats waited unread)
    # and killed them all as hung, so the next call failed with HostLostError. The silence was
    # the controller's own; a controller service paused so killed every client's hosts.
    address = ray_cluster.get_runtime_context().gcs_address
    script = tmp_path / "paused.py"
    script.write_text(PAUSED)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PATHWAYS_JAX_HUNG_S=str(HUNG_S))
    proc = subprocess.Popen(
        [sys.executable, str(script), address, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert wait_for(lambda: (tmp_path / "ready").exists() or proc.poll() is not None, timeout=90)
        assert proc.poll() is None, proc.stdout.read()
        proc.send_signal(signal.SIGSTOP)
        time.sleep(2.5 * HUNG_S)  # the pause itself: the process does nothing meanwhile
        (tmp_path / "resumed").touch()
        proc.send_signal(signal.SIGCONT)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "after the pause: result matches jax.jit" in out, out[-3000:]
