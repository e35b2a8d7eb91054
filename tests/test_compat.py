"""Every patch of JAX, Flax and Orbax lives in ``compat``, is in place, and targets the installed versions.

The behaviour the patches give (``jax.jit(future)``, ``jnp`` on futures,
Orbax and Flax checkpoints of futures) is tested against ``jax.jit`` where it
is used (test_futures, test_future_arraylike, test_dropin_idioms); here: that
each patch is installed on these versions, so that an upgrade that removes a
hook fails here by name instead of degrading silently.
"""

import ast
import importlib.metadata
import pathlib

import jax
import jax.numpy as jnp

import pathways_jax as pw
from pathways_jax._src import compat
from pathways_jax._src.compat import jax_caches, jax_futures
from pathways_jax._src.runtime.futures import Future

SRC = pathlib.Path(pw.__file__).parent / "_src"


def test_the_installed_versions_are_the_ones_the_patches_were_written_for():
    """An upgrade of one of them fails here first: review compat/ for it, then move WRITTEN_FOR."""
    for package, written_for in compat.WRITTEN_FOR.items():
        installed = tuple(int(part) for part in importlib.metadata.version(package).split(".")[:2])
        assert installed == written_for, (
            f"{package} {installed} is installed; compat/ was written for {written_for}"
        )


def test_importing_pathways_jax_installs_every_jax_hook():
    want = {
        "pytype_aval_mappings",
        "canonicalize_value_handlers",
        "shard_arg_handlers",
        "_check_prng_key",
        "_device_get",
        "from_raw_indices",
        "_split",
    }
    assert {name for name, installed in jax_futures.HOOKS.items() if installed} == want
    from jax._src import core
    from jax._src.interpreters import pxla

    assert Future in core.pytype_aval_mappings
    assert Future in pxla.shard_arg_handlers
    assert getattr(jax.effects_barrier, "_waits_for_programs", False)
    barrier = jax.effects_barrier
    assert compat.install() is True  # once: a second install changes nothing
    assert jax.effects_barrier is barrier
    from jax._src import util

    assert jax_caches.PROGRAMS in util._caches  # jax.clear_caches() clears programs too
    assert compat.install() is True and len([c for c in util._caches if c is jax_caches.PROGRAMS]) == 1
    pw.init()
    f = pw.program(lambda v: v + 1)
    future = f(jnp.arange(3.0))
    assert jax.jit(lambda v: v * 2)(future).tolist() == jax.jit(lambda v: v * 2)(jnp.arange(3.0) + 1).tolist()
    pw.shutdown()


def test_checkpoint_patches_are_installed_once_orbax_is_in():
    import flax.serialization
    import orbax.checkpoint as ocp
    from orbax.checkpoint import checkpoint_utils, type_handlers
    from orbax.checkpoint._src.handlers.base_pytree_checkpoint_handler import BasePyTreeCheckpointHandler

    compat.install_checkpoints()
    # One handler for futures and jax.Array: a tree holding both writes its metadata once.
    handler = type_handlers.get_type_handler(Future)
    assert type(handler).__name__ == "HostArrayHandler"
    assert type_handlers.get_type_handler(jax.Array) is handler
    assert getattr(checkpoint_utils.construct_restore_args, "_takes_futures", False)
    assert getattr(ocp.StandardCheckpointHandler.restore, "_takes_futures", False)
    # The save-time rewrite of futures into arrays is for the older two-handler path only.
    assert not getattr(BasePyTreeCheckpointHandler.async_save, "_takes_futures", False)
    assert Future in flax.serialization._STATE_DICT_REGISTRY
    assert getattr(flax.serialization._msgpack_ext_pack, "_takes_futures", False)


def test_the_flax_patches_are_installed_once_flax_is_in():
    from flax import nnx
    from flax.core import scope
    from flax.nnx import pytreelib

    compat.install_flax()
    patched = (
        nnx.Variable.set_value,
        nnx.RngStream.__init__,
        nnx.Dropout.__call__,
        scope._is_valid_rng,
    )
    assert all(getattr(function, "_takes_futures", False) for function in patched)
    assert Future in pytreelib.DATA_REGISTRY  # a module's attribute holding a future is data
    compat.install_flax()  # once: a second install changes nothing
    assert patched == (
        nnx.Variable.set_value,
        nnx.RngStream.__init__,
        nnx.Dropout.__call__,
        scope._is_valid_rng,
    )


def test_no_module_outside_compat_patches_jax_flax_or_orbax():
    """Assigning to an attribute of a jax, flax or orbax module or class happens in compat/ alone."""
    patched = []
    for path in SRC.rglob("*.py"):
        if path.parent.name == "compat":
            continue
        tree = ast.parse(path.read_text())
        imported = set()
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.split(".")[0] in ("jax", "flax", "orbax")
            ):
                imported.update(alias.asname or alias.name for alias in node.names)
            elif isinstance(node, ast.Import):
                imported.update(
                    (alias.asname or alias.name).split(".")[0]
                    for alias in node.names
                    if alias.name.split(".")[0] in ("jax", "flax", "orbax")
                )
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if isinstance(target, ast.Attribute | ast.Subscript):
                    root = target.value
                    while isinstance(root, ast.Attribute | ast.Subscript):
                        root = root.value
                    if isinstance(root, ast.Name) and root.id in imported:
                        patched.append(f"{path.relative_to(SRC)}:{node.lineno}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                first = node.args[0] if node.args else None
                if isinstance(first, ast.Name) and first.id in imported:
                    patched.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert patched == []
