"""The controller service as client processes and shells written from the README meet it.

Results are compared with plain ``jax.jit`` on the same inputs; the command line's own checks
need no service (``pw.serve`` is replaced where a test only reads what it was given).
"""

from __future__ import annotations

import types

import pytest

import pathways_jax as pw

pytestmark = pytest.mark.timeout(180)


def test_the_command_line_takes_address_and_name_after_its_command_too(monkeypatch, capsys):
    # `python -m pathways_jax serve --hosts 4 --address HEAD:6379` (or `stats --name eval`) was
    # refused as "unrecognized arguments": --address and --name were taken only before the
    # command, where the README's lines (`python -m pathways_jax stats`) never show them.
    from pathways_jax.__main__ import main

    given: dict = {}
    asked: list = []

    def serve(name, **kwargs):
        given.update(kwargs, name=name)
        return types.SimpleNamespace(name=name, address="here:1")

    def service(name, *, address=None):
        asked.append((name, address))
        return types.SimpleNamespace(stats=lambda: {"name": name}, stop=lambda: None)

    monkeypatch.setattr(pw, "serve", serve)
    monkeypatch.setattr(pw, "service", service)
    assert main(["serve", "--hosts", "2", "--address", "head:6379", "--name", "eval"]) == 0, (
        capsys.readouterr()
    )
    assert (given["name"], given["address"], given["hosts"]) == ("eval", "head:6379", 2)
    assert main(["stats", "--name", "eval", "--address", "head:6379"]) == 0, capsys.readouterr()
    assert main(["stop", "--name=eval"]) == 0, capsys.readouterr()
    assert asked == [("eval", "head:6379"), ("eval", "auto")]
    # Given on both sides, the one after the command is the one meant (as it reads).
    assert main(["--name", "a", "stop", "--name", "b"]) == 0
    assert asked[-1] == ("b", "auto")
    # Before the command, as before; left out, the defaults.
    given.clear()
    assert main(["--address", "h:1", "--name", "n", "serve", "--hosts", "1"]) == 0
    assert (given["name"], given["address"]) == ("n", "h:1")
    given.clear()
    assert main(["serve", "--hosts", "1"]) == 0
    assert (given["name"], given["address"]) == ("pathways", "auto")


def test_the_command_line_refuses_to_serve_in_a_ray_cluster_that_ends_with_it(monkeypatch, capsys):
    # `python -m pathways_jax serve --address local --hosts 1` started a Ray cluster in the
    # command's own process, printed "is running in the Ray cluster at ..." with a join line,
    # and returned: the cluster, and the service in it, ended with the command, and the line
    # printed named nothing any more.
    from pathways_jax.__main__ import main

    monkeypatch.setattr(pw, "serve", lambda *a, **k: pytest.fail("pw.serve was called"))
    for argv in (
        ["serve", "--hosts", "1", "--address", "local"],
        ["--address", "local", "serve", "--hosts", "1"],
    ):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "--address local" in err and "ends with this command" in err, err
        assert "ray start --head" in err, err
