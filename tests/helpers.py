"""Shared test helpers: comparing program results with plain jax.jit."""

import contextlib
import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap
import time

import jax
import numpy as np


def init_with_ema(params):
    """A train state whose EMA starts as the parameters themselves (one value returned twice)."""
    return {"params": params, "ema": params}


def train_with_ema(state, x):
    """One step of that state: the parameters, then their EMA."""
    params = jax.tree.map(lambda w: w - 0.1 * x.mean(), state["params"])
    ema = jax.tree.map(lambda e, w: 0.9 * e + 0.1 * w, state["ema"], params)
    return {"params": params, "ema": ema}


def assert_matches(got, want, rtol=1e-6, atol=1e-6):
    """Compares a pytree of futures/arrays with a pytree of reference arrays."""
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree, f"structure {got_tree} != {want_tree}"
    for g, w in zip(got_leaves, want_leaves, strict=True):
        value = g.result(timeout=120) if hasattr(g, "result") else g
        assert value.shape == w.shape, f"shape {value.shape} != {w.shape}"
        assert value.dtype == w.dtype, f"dtype {value.dtype} != {w.dtype}"
        np.testing.assert_allclose(np.asarray(value), np.asarray(w), rtol=rtol, atol=atol)


@contextlib.contextmanager
def jax_config(name, value):
    """``jax.config.update(name, value)`` for the block, the old value restored after it."""
    old = getattr(jax.config, name)
    jax.config.update(name, value)
    try:
        yield
    finally:
        jax.config.update(name, old)


def wait_for(predicate, timeout: float = 20.0) -> bool:
    """Looks at ``predicate()`` every 50 ms for up to ``timeout`` seconds; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_source(source: str, *args: str, timeout: float = 100, cwd=None) -> subprocess.CompletedProcess:
    """Runs Python ``source`` in a fresh interpreter on CPU (its own device count); the finished process."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
        check=False,
    )


def run_script(relative: str, *args: str, timeout: float = 280, python_args: tuple[str, ...] = ()) -> str:
    """Runs one of the repository's scripts (an example, a benchmark) in its own process.

    Its own process, because a script sets its own CPU device count. Fails the
    test, showing both streams, unless it exits with 0; returns its stdout.
    """
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the script picks its own device count
    proc = subprocess.run(
        [sys.executable, *python_args, str(ROOT / relative), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, (
        f"{relative} exited with {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    return proc.stdout


class Script:
    """One of the repository's scripts running in its own process (see :func:`start_script`)."""

    def __init__(self, relative: str, args: tuple[str, ...], timeout: float):
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env.pop("XLA_FLAGS", None)  # the script picks its own device count
        self.relative, self.timeout = relative, timeout
        # Files, not pipes: nobody reads a pipe while the script runs, and a full one would stop it.
        self.out = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed once it ended
        self.err = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.said = ("", "")
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / relative), *args],
            stdout=self.out,
            stderr=self.err,
            text=True,
            env=env,
        )
        self.started = time.monotonic()

    def _streams(self) -> tuple[str, str]:
        """Both streams, read once it ended; its files are closed then."""
        if not self.out.closed:
            self.out.seek(0)
            self.err.seek(0)
            self.said = self.out.read(), self.err.read()
            self.out.close()
            self.err.close()
        return self.said

    def output(self) -> str:
        """Waits for it (up to ``timeout`` seconds from its start); its stdout. Fails the test,
        showing both streams, unless it exited with 0."""
        try:
            self.proc.wait(timeout=max(1.0, self.started + self.timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            out, err = self._streams()
            raise AssertionError(
                f"{self.relative} ran past {self.timeout} s\n--- stdout\n{out}\n--- stderr\n{err}"
            ) from None
        out, err = self._streams()
        assert self.proc.returncode == 0, (
            f"{self.relative} exited with {self.proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"
        )
        return out

    def stop(self) -> None:
        """Ends it if it still runs."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._streams()


def start_script(relative: str, *args: str, timeout: float = 280) -> Script:
    """Starts one of the repository's scripts in its own process and returns at once.

    For tests whose scripts may run side by side: each mostly compiles on one
    core, and the machine may have more. :meth:`Script.output` is
    :func:`run_script`'s answer; :meth:`Script.stop` ends it if it still runs.
    """
    return Script(relative, args, timeout)


class Backlog:
    """Scripts that run in the background, ``running`` at a time, while the suite goes on.

    A test's script runs in its own process and mostly waits or compiles on one core: started
    in the suite's order it keeps the machine's other core idle while the test waits for it.
    Here the scripts of the session's tests start at the session's start, in the order given,
    and each test reads its own (:meth:`get`), which starts at once if its turn has not come.
    """

    def __init__(self, scripts: dict, folder: pathlib.Path, running: int = 1, timeout: float = 280):
        import threading

        # test id -> (script, args); a benchmark also gets ``--out=`` a folder of its own
        self._waiting = dict(scripts)
        self._folder, self._timeout = folder, timeout
        self._started: dict = {}  # test id -> (Script, its folder)
        self._lock = threading.Lock()
        self._stopped = False
        self._feeders = [threading.Thread(target=self._feed, daemon=True) for _ in range(running)]
        for feeder in self._feeders:
            feeder.start()

    def _start(self, test_id: str) -> tuple:
        """Starts ``test_id``'s script (the lock held)."""
        script, *args = self._waiting.pop(test_id)
        out = self._folder / f"run{len(self._started)}"
        out.mkdir()
        if script.startswith("benchmarks/"):
            args = [*args, f"--out={out}"]
        self._started[test_id] = (Script(script, tuple(args), self._timeout), out)
        return self._started[test_id]

    def _feed(self) -> None:
        """Starts the next waiting script once the one this feeder started ended, until none waits."""
        while True:
            with self._lock:
                if self._stopped or not self._waiting:
                    return
                run, _ = self._start(next(iter(self._waiting)))
            with contextlib.suppress(subprocess.TimeoutExpired):  # the test reports it
                run.proc.wait(timeout=self._timeout)

    def get(self, test_id: str) -> tuple:
        """``(Script, its --out folder)`` of ``test_id``, started now if it was still waiting."""
        with self._lock:
            if test_id in self._started:
                return self._started[test_id]
            if test_id not in self._waiting:
                raise KeyError(f"{test_id} has no background script (conftest.py's BACKGROUND)")
            return self._start(test_id)

    def stop(self) -> None:
        """Starts nothing more and ends every script still running."""
        with self._lock:
            self._stopped = True
            started = list(self._started.values())
        for run, _ in started:
            run.stop()


def gated(slice_, plus=0.0):
    """A program on ``slice_`` whose host callback waits for a gate: it holds the island's window.

    Returns ``(program, gate, entered)``: ``entered`` is set once a call reached the
    callback; the call finishes once ``gate`` is set (or after 30 s). The program
    returns its input plus ``plus``.
    """
    import threading

    import pathways_jax as pw

    gate, entered = threading.Event(), threading.Event()

    def wait(v):
        entered.set()
        gate.wait(30)
        return v

    program = pw.jit(
        lambda x: jax.pure_callback(wait, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + plus, devices=slice_
    )
    return program, gate, entered


def mlp_apply(p, x):
    """A tiny MLP's forward pass (the data-parallel tests' model, as ``(params, apply)``)."""
    return jax.numpy.tanh(x @ p["w1"]) @ p["w2"]


def mse(out, y):
    return jax.numpy.mean((out - y) ** 2)


def mlp_params():
    """The tiny MLP's parameters: 8 -> 16 -> 2."""
    return {
        "w1": jax.random.normal(jax.random.key(0), (8, 16)) * 0.3,
        "w2": jax.random.normal(jax.random.key(1), (16, 2)) * 0.3,
    }


def mlp_batches(steps, batch, seed=0):
    """``steps`` batches of ``batch`` examples for the tiny MLP: inputs and targets, float32."""
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(steps, batch, 8)).astype(np.float32),
        rng.normal(size=(steps, batch, 2)).astype(np.float32),
    )


@functools.cache
def modules_of_a_fresh_import() -> dict[str, list[str]]:
    """The modules a fresh Python process has loaded after ``import pathways_jax`` (``"package"``),
    then after ``import pathways_jax.pipeline`` too (``"pipeline"``).

    One process for every test that asks (a Python and JAX start costs seconds).
    """
    code = (
        "import json, sys\n"
        "import pathways_jax\n"
        "package = sorted(sys.modules)\n"
        "import pathways_jax.pipeline\n"
        "print(json.dumps({'package': package, 'pipeline': sorted(sys.modules)}))\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def interrupt_once(when):
    """Raises KeyboardInterrupt where a handler could first run once ``when()`` is true."""
    fired = []

    def hook(frame, event, arg):
        if not fired and event in ("call", "c_return") and when():
            fired.append(event)
            raise KeyboardInterrupt

    sys.setprofile(hook)
    try:
        yield fired
    finally:
        sys.setprofile(None)
