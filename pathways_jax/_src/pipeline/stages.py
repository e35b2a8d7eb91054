"""Model stages in one internal form, and the partition specs of their values."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import errors as flax_errors
from flax import linen, nnx
from flax.nnx import bridge

import pathways_jax as pw
from pathways_jax._src.pipeline.flags import (
    FLAG_NAMES,
    StageRefused,
    TrainFlag,
    UnreachedFlag,
    check_train_kw,
    signature_of,
)
from pathways_jax._src.pipeline.optimizers import OptaxLike
from pathways_jax._src.pipeline.optimizers import check_optimizers as check_optimizers
from pathways_jax._src.pipeline.optimizers import trained_filters as trained_filters

Apply = Callable[[Any, Any], Any]
# (params, x, rngs, train, train_kw) -> y: rngs a mapping of typed keys or None, train a bool
# or None, train_kw the keyword the user named for the flag or None.
Call = Callable[[Any, Any, Mapping[str, jax.Array] | None, bool | None, str | None], Any]
# A stage's parameter specs: None (replicated), one pw.P for every leaf, a
# function (key path, leaf) -> pw.P | None, or a pytree prefix of the params
# with a pw.P or None at each of its leaves.
ParamSpecs = pw.P | Callable[[Any, Any], pw.P | None] | Any | None


@dataclasses.dataclass(frozen=True, slots=True)
class Stage:
    """One stage of a model: trainable ``params`` and ``apply(params, x) -> y``.

    Non-trainable state (an NNX module's non-``Param`` variables, a Linen
    module's other collections) is closed over by ``apply`` and held fixed.
    ``call(params, x, rngs, train, train_kw)`` runs the stage with RNG streams
    and a training flag (see :func:`as_stage`); ``None`` means the stage takes
    neither and ``apply`` is used. ``flag`` says how the stage takes ``train``.
    ``running``: the running statistics (BatchNorm's) that the stage's forward
    updates in training, which a step would hold fixed instead; ``trains_untold``:
    a layer keeping them is in training mode by its own attribute.
    """

    params: Any
    apply: Apply
    kind: str
    description: str
    call: Call | None = None
    flag: TrainFlag | None = None
    running: tuple[str, ...] = ()
    trains_untold: bool = False

    def check_train(self, train: bool | None, train_kw: str | None, index: int, what: str) -> None:
        """Raises ``ProgramTraceError`` if ``train=True`` cannot reach this stage (see :func:`as_stage`).

        Also if the step would update running statistics of the stage, which it
        would hold fixed: training with them would differ from the plain model's
        silently (its evaluation would use their initial values).
        """
        if self.running and (train is True or (train is None and self.trains_untold)):
            shown = ", ".join(self.running[:4]) + (", ..." if len(self.running) > 4 else "")
            asked = (
                "train=True was asked"
                if train is True
                else "no train= was given and a layer is in training mode (use_running_average=False)"
            )
            raise pw.errors.ProgramTraceError(
                f"{what}: {asked}, but stage {index} ({self.description}) keeps running statistics "
                f"that training updates ({shown}: BatchNorm's), and pipelines train only parameters: "
                "those would stay at their initial values, and evaluation would use them. Use a "
                "normalisation without running statistics in pipelined stages (nnx.LayerNorm, "
                "nnx.GroupNorm, nnx.RMSNorm), or train the model as one program (@pw.program where "
                "nnx.jit or jax.jit stood), which updates them as nnx.jit does. To evaluate with the "
                "running statistics as they are, pass train=False."
            )
        if self.flag is not None:
            self.flag.check(train, train_kw, index=index, description=self.description, what=what)
        elif train is True and self.call is None:
            raise pw.errors.ProgramTraceError(
                f"{what}: train=True was asked, but stage {index} ({self.description}) has no call "
                "that takes a flag (Stage.call is None); give it one, or call with train=False."
            )

    def run(
        self,
        params: Any,
        x: Any,
        rngs: Mapping[str, jax.Array] | None,
        train: bool | None,
        train_kw: str | None = None,
    ) -> Any:
        """The stage's output with these RNG streams and training flag."""
        if self.call is None:
            return self.apply(params, x)
        return self.call(params, x, rngs, train, train_kw)


@dataclasses.dataclass(frozen=True, slots=True)
class StaleDraw:
    """An NNX stage drew random numbers from one of its own RNG streams that the step's ``rngs`` do not reseed.

    Such a stream starts every node from the same key and count, so every step and every
    microbatch would draw the same numbers (the same dropout mask), where ``nnx.jit``
    advances the stream call by call.
    """

    description: str
    path: str  # where the stream sits in the module, e.g. "dropout.rngs"
    tag: str  # the stream's name, e.g. "default" or "dropout"


# While a check traces the stages (abstractly, before anything runs), NNX stages note here
# the own streams they draw from that the step's rngs do not reseed (see StaleDraw).
_STALE_DRAWS: contextvars.ContextVar[list[StaleDraw] | None] = contextvars.ContextVar(
    "pipeline_stale_draws", default=None
)


@contextlib.contextmanager
def recording_stale_draws() -> Iterator[list[StaleDraw]]:
    """Collects the :class:`StaleDraw` s of the stage calls traced inside the block."""
    record: list[StaleDraw] = []
    token = _STALE_DRAWS.set(record)
    try:
        yield record
    finally:
        _STALE_DRAWS.reset(token)


def stale_draws_error(
    draws: Sequence[StaleDraw], given: Sequence[str], where: str, train: bool | None = None
) -> pw.errors.ProgramTraceError:
    """The error for stages that would draw the same random numbers every step (see :class:`StaleDraw`).

    ``train``: the call's flag. Under ``train=False`` a stage that still draws
    (an ``nnx.RNN`` drawing its initial carry) is not told to pass it again.
    """
    shown = "; ".join(f"{d.description} draws from its stream {d.tag!r} at {d.path}" for d in draws[:4])
    tags = sorted({d.tag for d in draws})
    if train is False:
        way_out = "; it draws under train=False too, so only fresh keys make each call draw anew."
    else:
        way_out = ", or pass train=False to run without randomness."
    return pw.errors.ProgramTraceError(
        f"{where}: {shown}, which the call's rngs (streams {sorted(given) or 'none'}) do not reseed, so "
        "every step and every microbatch would use the same random numbers (the same dropout mask), "
        "unlike nnx.jit, which advances the stream on every call. Pass a fresh key for each such "
        f"stream every step, e.g. rngs={{{', '.join(f'{t!r}: jax.random.fold_in(key, step)' for t in tags)}}} "
        "(a layer built with nnx.Rngs(0) draws from the 'default' stream; build it with "
        f"nnx.Rngs(0, dropout=1) to name it 'dropout'){way_out}"
    )


def _stream_counts(module: nnx.Module) -> dict[tuple, tuple[str, Any]]:
    """Every RNG stream of ``module`` by path: its tag and its count's current value."""
    return {
        path: (node.tag, node.count.get_value())
        for path, node in nnx.iter_graph(module)
        if isinstance(node, nnx.RngStream)
    }


def _held_values(module: nnx.Module) -> dict[tuple, Any]:
    """The value of every Variable of ``module`` but its RNG streams' (which steps reseed), by path."""
    return {
        path: node.get_value()
        for path, node in nnx.iter_graph(module)
        if isinstance(node, nnx.Variable) and not isinstance(node, nnx.RngState)
    }


def _refuse_held_writes(module: nnx.Module, held: dict[tuple, Any], stage: str) -> None:
    """Raises :class:`StageRefused` if the call of ``module`` wrote a Variable ``held`` had (see :func:`_held_values`).

    A pipeline's nodes take the parameters and hold every other Variable as
    it is: one the forward writes (a step counter, a moving average, a KV
    cache) would keep its first value on every step, where ``nnx.jit``
    writes it back. BatchNorm's statistics are refused by name before this
    (``Stage.check_train``); this catches the rest.
    """
    written = [
        (path, node)
        for path, node in nnx.iter_graph(module)
        if path in held and isinstance(node, nnx.Variable) and node.get_value() is not held[path]
    ]
    if not written:
        return
    shown = ", ".join(
        f"{'.'.join(str(part) for part in path)} ({type(node).__name__})" for path, node in written[:4]
    )
    raise StageRefused(
        f"{stage} writes {shown} in its call, and pipelines train only parameters, holding every other "
        "Variable as it is: it would keep its first value on every step and every microbatch, where "
        "nnx.jit writes it back into the module. Keep such state out of pipelined stages (pass it in "
        "with the batch, or compute it outside), or train the model as one program (@pw.program where "
        "nnx.jit stood), which updates it as nnx.jit does."
    )


@contextlib.contextmanager
def _refusing_linen_writes(stage: str) -> Iterator[None]:
    """Raises :class:`StageRefused` where a Linen stage's call writes a collection other than ``params``.

    The pipeline applies it as ``module.apply`` does without ``mutable=``: a
    write (a counter of its own, a cache, BatchNorm's ``batch_stats`` where no
    flag reaches it) fails there with Flax's ``ModifyScopeVariableError``,
    which is neither a shape nor an RNG problem: say what it is.
    """
    try:
        yield
    except flax_errors.ModifyScopeVariableError as exc:
        detail = str(exc).split(" (https://", 1)[0]
        raise StageRefused(
            f"{stage} writes a variable in its call ({detail}), and pipelines train only a Linen "
            "stage's 'params', holding its other collections as they are (module.apply without "
            "mutable=): it would keep its first value on every step, where jax.jit with "
            "mutable=[...] returns the new one. Keep such state out of pipelined stages, or "
            "train the model as one program (@pw.program where jax.jit stood), with mutable= "
            "as under jax.jit."
        ) from exc


def _flag_call(model: nnx.Module) -> Any:
    """The call whose keywords take ``train`` when ``model`` is called with it.

    ``nnx.Sequential`` hands its keyword arguments to its first layer only (later layers get
    the previous one's output), so the flag can go there only if that layer takes it; its
    other layers are switched by their attributes, as ``model.train()`` switches them. A
    first layer that is itself an ``nnx.Sequential`` hands them on to its own first layer.
    """
    while isinstance(model, nnx.Sequential) and model.layers:
        first = model.layers[0]
        if not isinstance(first, nnx.Module):
            return first
        model = first
    if isinstance(model, bridge.ToNNX):  # a Linen module in NNX: its keywords go to the Linen call
        return type(model.to_nnx__module).__call__
    return type(model).__call__


def _nnx_flag(model: nnx.Module) -> TrainFlag:
    """How an NNX module takes ``train``: its ``__call__``'s keywords and its layers' attributes."""
    signature = signature_of(_flag_call(model))
    switched = random = False
    # A Linen module in NNX (bridge.ToNNX) as the stage is called with the call's rngs only, as a
    # Linen stage is: its own streams are never drawn, and its Linen call says what it takes.
    bridged = isinstance(model, bridge.ToNNX)
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and (
            hasattr(node, "deterministic") or hasattr(node, "use_running_average")
        ):
            switched = True
        if isinstance(node, nnx.RngStream | nnx.Rngs) and not (bridged and path[:1] == ("to_nnx__rngs",)):
            random = True
    random = random or (not bridged and signature_of(type(model).__call__).takes("rngs"))
    return TrainFlag(signature, switched=switched, inert=not (switched or random))


def linen_holds(module: linen.Module, variables: Mapping[str, Any], params: Any, x: Any) -> str:
    """What in a Linen module a ``train`` flag would switch, found by calling it abstractly on ``x``.

    A Linen module's layers (a compact module's children) are known only when it is
    called: this calls ``module.apply`` under ``jax.eval_shape`` without RNG streams,
    recording the Dropout and BatchNorm layers it calls, and whether it needs a stream
    (``InvalidRngError``). ``""`` when it calls none and needs none: ``train`` cannot
    change its output. Another failure of the call is left to the call itself.
    """
    found: list[str] = []

    def record(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        layer = context.module
        if context.method_name == "__call__" and (
            isinstance(layer, linen.Dropout | linen.BatchNorm) or hasattr(layer, "use_running_average")
        ):
            path = "/".join(layer.scope.path) if layer.scope is not None else ""
            found.append(f"calls a linen {type(layer).__name__} at {path or '<root>'}")
        return next_fun(*args, **kwargs)

    try:
        with linen.intercept_methods(record):
            jax.eval_shape(lambda p, x: module.apply({"params": p, **variables}, x), params, x)
    except flax_errors.InvalidRngError as exc:
        if not found:
            stream = re.search(r'PRNG for "([^"]+)"', str(exc))
            found.append(f"draws from the RNG stream {stream.group(1) if stream else 'dropout'!r}")
    except Exception:  # its own error, raised again where the stage is called
        pass
    shown = list(dict.fromkeys(found))
    return ", ".join(shown[:3]) + (", ..." if len(shown) > 3 else "")


def _running_statistics(model: nnx.Module) -> tuple[tuple[str, ...], bool]:
    """An NNX module's running statistics (``nnx.BatchStat`` paths), and whether a layer keeping them trains.

    A layer trains them when its ``use_running_average`` is False (nnx.BatchNorm's default).
    """
    names = tuple(
        ".".join(str(part) for part in path)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.BatchStat)
    )
    trains = any(
        isinstance(node, nnx.Module) and getattr(node, "use_running_average", True) is False
        for _, node in nnx.iter_graph(model)
    )
    return names, trains


def as_stage(model: Any, index: int = 0, *, wrt: Any = None) -> Stage:
    """Normalises a stage into :class:`Stage`: trainable ``params`` and ``apply(params, x)``.

    Args:
      model: a Flax NNX module (its ``nnx.Param`` values are the params, as plain arrays),
        a ``(linen_module, variables)`` pair (``variables["params"]``), a
        ``(params, apply_fn)`` pair, or a function of the activations alone
        (``nnx.relu``, as in ``nnx.Sequential``'s layers: no params).
      index: the stage's position, named in errors.
      wrt: for an NNX module, the filter of the Variables that are its params
        (``nnx.All(nnx.Param, optimizer.wrt)`` for an ``nnx.Optimizer``'s, see
        :func:`trained_filters`); its other Variables are held as they are.
        ``None``: every ``nnx.Param``.

    When a step is given ``train=`` (``True``/``False``), the stage's call
    (an NNX or Linen module's ``__call__``, or ``apply_fn``) gets it under the
    name it takes: the step's ``train_kw=`` name if given and taken, else
    ``train``, else ``training`` (nanoGPT), else ``deterministic`` with the
    opposite sense (``not train``); a call with ``**kwargs`` gets ``train``
    (or the ``train_kw`` name). Its signature is read once per class. An NNX
    module is also switched with ``set_attributes(deterministic=not train,
    use_running_average=not train)``, as ``module.train()``/``module.eval()``
    do. ``train=True`` for a stage that none of these reach raises
    ``ProgramTraceError`` (an NNX module with no such layer, no RNG stream and
    no ``rngs`` parameter is exempt: the flag cannot change it; so is a Linen
    module that, traced on its input, calls no Dropout or BatchNorm and needs
    no RNG stream, see :func:`linen_holds`, and an ``apply_fn(params, x)`` or a
    function ``f(x)`` that takes nothing more);
    ``train=False`` and ``train=None`` (passes nothing) never raise.
    When a step is given ``rngs`` (stream name to key), a Linen stage gets
    them as ``module.apply(..., rngs=rngs)``, an ``apply_fn`` taking ``rngs``
    gets the mapping, and an NNX module gets ``nnx.Rngs(**rngs)`` if its
    ``__call__`` has an ``rngs`` parameter (and its own streams, which layers it
    does not hand them to draw from, are reseeded from keys folded from them),
    else its own streams are reseeded with them (``nnx.reseed``). A pipeline's checks reject an NNX stage that
    draws from one of its own streams that ``rngs`` does not reseed: it would
    draw the same numbers on every step (see :class:`StaleDraw`).

    Returns:
      A :class:`Stage`.

    Raises:
      ProgramTraceError: ``model`` is none of the above.

    Example:
      >>> from flax import nnx
      >>> from pathways_jax.pipeline import as_stage
      >>> stage = as_stage(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
      >>> stage.kind, stage.params["kernel"].shape
      ('nnx', (2, 3))
    """
    if isinstance(model, Stage):
        return model
    if isinstance(model, nnx.Module):
        # Flax types split() with two filters as variadic; it returns exactly three parts.
        trained = nnx.Param if wrt is None else wrt
        graphdef, params, rest = nnx.split(model, trained, ...)  # type: ignore[misc]
        # Plain arrays, not the module's Variables: nodes taking the params never write
        # back into the user's module (programs update Variables they are given in place).
        params = nnx.as_pure(params)
        nnx_flag = _nnx_flag(model)
        takes_rngs = "rngs" in signature_of(type(model).__call__).names
        running, trains_untold = _running_statistics(model)
        description = f"nnx {type(model).__name__}"

        def apply_nnx(p: Any, x: Any) -> Any:
            return nnx.merge(graphdef, p, rest)(x)

        def call_nnx(
            p: Any, x: Any, rngs: Mapping[str, jax.Array] | None, train: bool | None, train_kw: str | None
        ) -> Any:
            module = nnx.merge(graphdef, p, rest, copy=True)  # fresh variables: reseed may mutate them
            if train is not None:
                module.set_attributes(
                    deterministic=not train, use_running_average=not train, raise_if_not_found=False
                )
            kwargs: dict[str, Any] = nnx_flag.kwargs(train, train_kw)
            reseeded: tuple[str, ...] = ()
            if rngs and takes_rngs:
                kwargs["rngs"] = nnx.Rngs(**rngs)
                # Layers the call does not hand its rngs to (an nnx.Sequential gives them only to
                # layers whose __call__ takes rngs) draw from their own streams: those are reseeded
                # too, from keys of their own (not those the call's rngs give, whose draws would
                # repeat theirs).
                own = {name: _own_streams_key(key) for name, key in rngs.items()}
                nnx.reseed(module, policy="match_shape", **own)
                reseeded = tuple(rngs)
            elif isinstance(model, bridge.ToNNX):
                # As a Linen stage: the call's rngs only. Its own streams would be drawn on every
                # call (the same keys on every step here), whether the Linen module uses them or not.
                kwargs["rngs"] = nnx.Rngs()
            elif rngs:
                streams: Mapping[str, Any] = rngs  # keywords of reseed: stream names only
                nnx.reseed(module, **streams)
                reseeded = tuple(streams)
            record = _STALE_DRAWS.get()
            if record is None:
                return module(x, **kwargs)
            before = _stream_counts(module)
            held = _held_values(module)
            out = module(x, **kwargs)
            _refuse_held_writes(module, held, f"stage {index} ({description})")
            for path, (tag, count) in _stream_counts(module).items():
                if count is not before[path][1] and tag not in reseeded:  # drawn from, not reseeded
                    record.append(
                        StaleDraw(f"stage {index} ({description})", ".".join(str(part) for part in path), tag)
                    )
            return out

        return Stage(
            params,
            apply_nnx,
            "nnx",
            description,
            call_nnx,
            nnx_flag,
            running,
            trains_untold,
        )
    if isinstance(model, tuple | list) and len(model) == 2:
        first, second = model
        if isinstance(first, linen.Module):
            variables = dict(second) if second is not None else {}
            if "params" not in variables:
                raise pw.errors.ProgramTraceError(
                    f"stage {index} is a Linen module {type(first).__name__} with variables "
                    f"holding {sorted(variables)}, but no 'params' collection; pass "
                    "(module, module.init(rng, x)) so the stage has parameters to train."
                )
            params = variables.pop("params")
            # A call without a flag keyword: whether train=True could change it is found by
            # tracing it (its layers are known only then), on its first call with train=True.
            linen_flag = TrainFlag(signature_of(type(first).__call__), probed=True)
            description = f"linen {type(first).__name__}"
            holds: dict[tuple, str] = {}  # by the input's shapes and dtypes

            variables = on_the_slice_mesh(variables)

            def apply_linen(p: Any, x: Any) -> Any:
                with _refusing_linen_writes(f"stage {index} ({description})"):
                    return first.apply({"params": on_the_slice_mesh(p), **variables}, x)

            def call_linen(
                p: Any, x: Any, rngs: Mapping[str, jax.Array] | None, train: bool | None, train_kw: str | None
            ) -> Any:
                if train is True and linen_flag.signature.flag_name(train_kw) is None:
                    key = signature(x)
                    if key not in holds:
                        holds[key] = linen_holds(first, variables, p, x)
                    if holds[key]:
                        raise UnreachedFlag(
                            linen_flag.unreached_message(train_kw, index, description, holds[key])
                        )
                kwargs: dict[str, Any] = linen_flag.kwargs(train, train_kw)
                with _refusing_linen_writes(f"stage {index} ({description})"):
                    return first.apply(
                        {"params": on_the_slice_mesh(p), **variables},
                        x,
                        rngs=dict(rngs) if rngs else None,
                        **kwargs,
                    )

            # Linen's own collection of running statistics (nn.BatchNorm's), held fixed here.
            stats = variables.get("batch_stats")
            running = tuple(
                "batch_stats" + jax.tree_util.keystr(path)
                for path, _ in jax.tree_util.tree_leaves_with_path(stats if stats is not None else {})
            )
            return Stage(params, apply_linen, "linen", description, call_linen, linen_flag, running)
        if callable(second) and not callable(first):
            # apply_fn(params, x) and nothing more (no flag, no rngs): train cannot change it.
            read = signature_of(second)
            fn_flag = TrainFlag(
                read, inert=len(read.names) <= 2 and not read.var_keyword and read.text != "(...)"
            )
            fn_signature = fn_flag.signature

            def call_fn(
                p: Any, x: Any, rngs: Mapping[str, jax.Array] | None, train: bool | None, train_kw: str | None
            ) -> Any:
                kwargs: dict[str, Any] = fn_flag.kwargs(train, train_kw)
                if rngs and fn_signature.takes("rngs"):
                    kwargs["rngs"] = dict(rngs)
                if train_kw is not None and "train_kw" in fn_signature.names:  # a sequential() model
                    kwargs["train_kw"] = train_kw
                return second(p, x, **kwargs)

            description = f"apply_fn {getattr(second, '__name__', second)!r}"
            return Stage(first, second, "function", description, call_fn, fn_flag)
    if callable(model) and not isinstance(model, nnx.Module | linen.Module | tuple | list):
        return _function_stage(model)
    raise pw.errors.ProgramTraceError(
        f"stage {index} is {type(model).__name__}: {model!r:.80}; expected a Flax NNX module, a "
        "(linen_module, variables) pair, or a (params, apply_fn) pair with "
        "apply_fn(params, x) -> y."
    )


def _function_stage(fn: Callable[..., Any]) -> Stage:
    """A function of the activations alone (``nnx.relu`` in ``nnx.Sequential``'s layers): no parameters.

    It gets the output of the stage before, as ``nnx.Sequential`` calls it, and ``train`` only if
    it takes a flag keyword; one that takes none cannot be changed by it (exempt from ``train=True``).
    """
    read = signature_of(fn)
    takes_flag = read.var_keyword or any(name in read.names for name in FLAG_NAMES)
    flag = TrainFlag(read, inert=not takes_flag)

    def apply_fn(p: Any, x: Any) -> Any:
        return fn(x)

    def call_fn(
        p: Any, x: Any, rngs: Mapping[str, jax.Array] | None, train: bool | None, train_kw: str | None
    ) -> Any:
        return fn(x, **flag.kwargs(train, train_kw))

    description = f"function {getattr(fn, '__name__', type(fn).__name__)!r}"
    return Stage(None, apply_fn, "function", description, call_fn, flag)


def as_stages(models: Sequence[Any], wrt: Sequence[Any] | None = None) -> list[Stage]:
    """Each of ``models`` as a :class:`Stage` (see :func:`as_stage`); ``wrt``: one filter per model, or None."""
    if isinstance(models, nnx.List):  # an NNX module's list of layers (nnx.Sequential's .layers)
        models = list(models)
    if isinstance(models, nnx.Module | linen.Module) or not isinstance(models, Sequence):
        raise pw.errors.ProgramTraceError(
            f"stages must be a sequence (list or tuple) of stages, got {type(models).__name__}; "
            + (
                "to run its layers as the stages, pass them: Pipeline(model.layers, slices, ...); "
                "to run it as one stage, wrap it in a list: Pipeline([model], [slice], ...)."
                if isinstance(models, nnx.Sequential)
                else "wrap a single model in a list: Pipeline([model], [slice], ...)."
            )
        )
    filters = [None] * len(models) if wrt is None else list(wrt)
    check_untied(models, filters)
    return [as_stage(model, i, wrt=filters[i]) for i, model in enumerate(models)]


def check_untied(models: Sequence[Any], wrt: Sequence[Any] | None = None) -> None:
    """Raises ``PlacementError`` if two NNX stages train the same ``nnx.Param`` (tied weights).

    Each stage's parameters are its own copy (on its own slice), so a parameter two stages
    share (an embedding whose ``attend`` is the output head) would train as two copies, each
    with one stage's gradients, where ``jax.jit`` of the model adds both into the one parameter.
    ``wrt``: per model, the filter of the Variables it trains (see :func:`as_stage`); one that
    leaves the shared parameter out (a frozen embedding) holds it as it is in both stages.
    """
    owners: dict[int, tuple[int, str]] = {}
    for index, model in enumerate(models):
        if not isinstance(model, nnx.Module):
            continue
        trained = nnx.filterlib.to_predicate(nnx.Param if wrt is None or wrt[index] is None else wrt[index])
        for path, node in nnx.iter_graph(model):
            if not isinstance(node, nnx.Param) or not trained(path, node):
                continue
            where = ".".join(str(part) for part in path)
            first = owners.setdefault(id(node), (index, where))
            if first[0] != index:
                raise pw.errors.PlacementError(
                    f"stage {first[0]} ({type(models[first[0]]).__name__}) at {first[1]} and stage "
                    f"{index} ({type(model).__name__}) at {where} hold the same nnx.Param (tied "
                    "weights). Each stage trains its own copy of its parameters, so the two would "
                    "drift apart, where jax.jit of the model adds both stages' gradients into the "
                    "one parameter. Keep the layers that share it in one stage, or give "
                    "DataParallel/DiLoCo the model as one nnx.Module holding its layers."
                )


def check_train(stages: Sequence[Stage], train: bool | None, train_kw: str | None, what: str) -> None:
    """Raises ``ProgramTraceError`` if ``train_kw`` is malformed or ``train=True`` cannot reach a stage."""
    check_train_kw(train_kw, what)
    for index, stage in enumerate(stages):
        stage.check_train(train, train_kw, index, what)


def check_slices(slices: Sequence[Any], count: int, what: str) -> list[pw.VirtualSlice]:
    slices = list(slices) if isinstance(slices, Sequence) else [slices]
    if len(slices) != count:
        raise pw.errors.PlacementError(
            f"{what} has {count} stages but {len(slices)} device slices were given; "
            "give one pw.devices(...) slice per stage (stages may share a slice)."
        )
    for i, slice_ in enumerate(slices):
        if not isinstance(slice_, pw.VirtualSlice):
            raise pw.errors.PlacementError(
                f"{what}: slice {i} is {slice_!r}; expected a slice from pw.devices(...)."
            )
        slice_.check_usable()
    return slices


def _is_spec(node: Any) -> bool:
    return node is None or isinstance(node, pw.P)


def _key_name(key: Any) -> Any:
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return getattr(key, attribute)
    return key


def _path(path: tuple) -> tuple:
    return tuple(_key_name(key) for key in path)


def _show(path: tuple) -> str:
    return "/".join(str(part) for part in path) or "<root>"


def _from_prefix(params: Any, specs: Any, where: str) -> Any:
    """Specs per parameter from a pytree prefix of ``params``, matched by key names.

    Matching by names (not node types) lets a plain dict describe an ``nnx.State``.
    """
    flat_specs, _ = jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)
    by_path = {}
    for path, spec in flat_specs:
        if not _is_spec(spec):
            raise pw.errors.PlacementError(
                f"{where}: entry {_show(_path(path))} is {type(spec).__name__} {spec!r:.60}; "
                "expected pw.P(...) or None (replicated) at every leaf of param_specs."
            )
        by_path[_path(path)] = spec
    param_paths = [_path(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    used: set[tuple] = set()
    missing: list[str] = []

    def pick(path: tuple, leaf: Any) -> pw.P:
        names = _path(path)
        for end in range(len(names), -1, -1):
            if names[:end] in by_path:
                used.add(names[:end])
                return by_path[names[:end]] or pw.P()
        missing.append(_show(names))
        return pw.P()

    tree = jax.tree_util.tree_map_with_path(pick, params)
    unknown = [_show(path) for path in by_path if path not in used]
    if missing or unknown:
        parts = ", ".join(_show(path) for path in param_paths[:8])
        more = f" and {len(param_paths) - 8} more" if len(param_paths) > 8 else ""
        problems = []
        if unknown:
            problems.append(f"entries {unknown[:4]} match no parameter")
        if missing:
            problems.append(f"parameters {missing[:4]} have no spec")
        raise pw.errors.PlacementError(
            f"{where} is not a pytree prefix of the params: {'; '.join(problems)}. The params have "
            f"{parts}{more}; give a pw.P or None for each of them or for a part holding them "
            "(or one pw.P for all, or a function (key_path, leaf) -> pw.P | None)."
        )
    return tree


def _check_fits(spec: pw.P, leaf: Any, slice_: pw.VirtualSlice, where: str) -> None:
    sizes = dict(zip(slice_.axis_names, slice_.shape, strict=True))
    shape = tuple(np.shape(leaf))
    if len(spec) > len(shape):
        raise pw.errors.PlacementError(
            f"{where} is {spec}, {len(spec)} entries for a parameter of shape {shape}; "
            "give at most one entry per dimension."
        )
    for dim, entry in zip(shape, spec, strict=False):
        parts = 1
        for name in entry if isinstance(entry, tuple) else (entry,):
            if name is None:
                continue
            if name not in sizes:
                raise pw.errors.PlacementError(
                    f"{where} is {spec}, which names axis {name!r}, but {slice_!r} has axes "
                    f"{slice_.axis_names}; use the slice's axis names."
                )
            parts *= sizes[name]
        if dim % parts:
            raise pw.errors.PlacementError(
                f"{where} is {spec}, which splits a dimension of size {dim} (shape {shape}) into "
                f"{parts} parts on {slice_!r}; the size must divide evenly."
            )


def _is_partitioned(node: Any) -> bool:
    return isinstance(node, linen.Partitioned)


def on_the_slice_mesh(tree: Any) -> Any:
    """Linen's ``nn.with_partitioning`` boxes without their ``mesh=``: constrained on the stage's slice.

    Flax constrains a boxed parameter to its names on the box's mesh when the module reads it,
    and a mesh of the user's (``mesh=m``) holds other devices than most stages' slices: without
    it the names apply on the mesh of the slice the stage runs on (see :func:`check_partitioning`).
    """
    return jax.tree.map(
        lambda node: node.replace(mesh=None) if _is_partitioned(node) and node.mesh is not None else node,
        tree,
        is_leaf=_is_partitioned,
    )


def check_partitioning(params: Any, slice_: pw.VirtualSlice, where: str) -> None:
    """Every mesh axis a Linen parameter's ``nn.with_partitioning`` names is one of ``slice_``'s.

    Raises:
      PlacementError: a parameter names an axis the slice's mesh lacks (Flax's sharding
        constraint would fail in the stage), naming the parameter, the axis and the slice's axes.
    """
    boxes = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_partitioned)[0]
    for path, box in boxes:
        if not _is_partitioned(box) or isinstance(box, linen.LogicallyPartitioned):
            continue  # logical names reach mesh axes through the rules in effect
        named = [
            axis
            for entry in box.names
            for axis in (entry if isinstance(entry, tuple) else (entry,))
            if axis is not None
        ]
        missing = [axis for axis in named if axis not in slice_.axis_names]
        if missing:
            raise pw.errors.PlacementError(
                f"{where}: parameter {_show(_path(path))} is declared with nn.with_partitioning names "
                f"{tuple(box.names)}, which Flax applies as a sharding constraint on the mesh the "
                f"stage runs on, but the slice's mesh has axes {tuple(slice_.axis_names)}, not "
                f"{missing[0]!r}. Give the slice that axis (pw.devices(mesh={{..., {missing[0]!r}: n}})) "
                "or declare the parameter without it."
            )


def param_specs(params: Any, specs: ParamSpecs, slice_: pw.VirtualSlice, where: str) -> Any:
    """A pytree of ``pw.P`` matching ``params``, each checked against ``slice_``.

    ``specs`` is ``None`` (replicated), one ``pw.P`` for every parameter, a function
    ``(key_path, leaf) -> pw.P | None``, or a pytree prefix of ``params`` with ``pw.P`` or
    ``None`` at its leaves. ``where`` names the specs in errors. NNX's
    ``nnx.get_partition_spec(nnx.state(model, nnx.Param))`` (variables holding specs) is such a
    prefix.
    """
    specs = jax.tree.map(
        lambda node: node.get_value() if isinstance(node, nnx.Variable) else node,
        specs,
        is_leaf=lambda node: isinstance(node, nnx.Variable),
    )
    if specs is None:
        return jax.tree.map(lambda _: pw.P(), params)
    if isinstance(specs, pw.P):
        tree = jax.tree.map(lambda _: specs, params)
    elif callable(specs) and not isinstance(specs, Mapping | Sequence):
        tree = jax.tree_util.tree_map_with_path(lambda path, leaf: specs(path, leaf) or pw.P(), params)
    else:
        tree = _from_prefix(params, specs, where)
    for (path, spec), leaf in zip(
        jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_spec)[0], jax.tree.leaves(params), strict=True
    ):
        if not isinstance(spec, pw.P):
            raise pw.errors.PlacementError(
                f"{where} gave {spec!r:.60} for parameter {_show(_path(path))}; expected pw.P(...) or None."
            )
        _check_fits(spec, leaf, slice_, f"{where} for parameter {_show(_path(path))}")
    return tree


def opt_state_specs(tx: OptaxLike, params: Any, specs: Any) -> Any:
    """Specs of ``tx.init(params)``: parameter-shaped subtrees follow ``specs``, the rest replicated."""
    abstract = jax.eval_shape(tx.init, params)
    structure = jax.tree_util.tree_structure(params)
    shapes = [leaf.shape for leaf in jax.tree.leaves(params)]

    def like_params(node: Any) -> bool:
        try:
            if jax.tree_util.tree_structure(node) != structure:  # type: ignore[operator]  # jaxlib has no PyTreeDef stubs
                return False
        except Exception:
            return False
        return [leaf.shape for leaf in jax.tree.leaves(node)] == shapes

    return jax.tree.map(lambda node: specs if like_params(node) else pw.P(), abstract, is_leaf=like_params)


def check_data_axis(slices: Sequence[pw.VirtualSlice], data_axis: Any, what: str) -> None:
    """Raises ``PlacementError`` if ``data_axis`` is not an axis name, or one no slice has.

    The default ``"data"`` splits the batch on the slices that have such an axis and is left
    alone; another name that no slice has (``data_axis="batch"`` on ``mesh={"data": 2}``) would
    silently run every example on every device of each slice, where ``jax.jit`` refuses a
    ``P("batch")`` its mesh lacks.
    """
    if data_axis is None:
        return
    axes = sorted({name for slice_ in slices for name in slice_.axis_names})
    if not isinstance(data_axis, str):
        raise pw.errors.PlacementError(
            f"{what}: data_axis is {type(data_axis).__name__} {data_axis!r}; expected the name of the "
            f"slices' mesh axis that splits the batch (their axes: {axes}), or None to split none."
        )
    if data_axis != "data" and not any(data_axis in slice_.axis_names for slice_ in slices):
        raise pw.errors.PlacementError(
            f"{what}: data_axis={data_axis!r} names an axis that none of the slices has (their axes: "
            f"{axes}); name the axis that splits the batch, e.g. pw.devices(mesh={{{data_axis!r}: 2}}) "
            "or data_axis=" + (repr(axes[0]) if axes else "None") + ", or pass data_axis=None to run "
            "the whole batch on every device of each slice."
        )


def activation_spec(slice_: pw.VirtualSlice, data_axis: str | None) -> pw.P:
    """Batch-leading values are split over ``data_axis`` when the slice has it."""
    if data_axis is not None and data_axis in slice_.axis_names:
        return pw.P(data_axis)
    return pw.P()


def data_parts(slice_: pw.VirtualSlice, data_axis: str | None) -> int:
    if data_axis is not None and data_axis in slice_.axis_names:
        return slice_.shape[slice_.axis_names.index(data_axis)]
    return 1


def _is_batch_leaf(node: Any) -> bool:
    # A list is one array (nested lists of numbers), as np.asarray reads it; tuples, dicts and
    # other pytree nodes hold several arrays (a dict batch, a tuple of targets).
    return isinstance(node, list)


def batch_leaves(x: Any, what: str) -> tuple[list[np.ndarray], Any, int]:
    """``x`` (an array or a pytree of arrays) as host arrays, its tree structure and its batch size.

    Every leaf leads with the batch dimension, of one size for all leaves.

    Raises:
      PlacementError: ``x`` has no arrays, a leaf is a scalar, or the leaves' batch sizes differ.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=_is_batch_leaf)
    if not flat:
        raise pw.errors.PlacementError(
            f"{what} is {type(x).__name__} {x!r:.60} with no arrays; expected an array, or a pytree "
            "(dict, tuple) of arrays, whose first dimension is the batch."
        )
    leaves: list[np.ndarray] = []
    for path, leaf in flat:
        name = what + jax.tree_util.keystr(path)
        try:
            array = np.asarray(leaf)
        except pw.errors.PathwaysError:
            # A future whose run failed (or whose host was lost): its own error, as reading it
            # anywhere raises, so `except ProgramFailedError` / `HostLostError` still catch it.
            raise
        except Exception as exc:
            raise pw.errors.PlacementError(
                f"{name} is {type(leaf).__name__} {leaf!r:.60}, not an array ({type(exc).__name__}: "
                f"{exc}); pass arrays whose first dimension is the batch."
            ) from exc
        if array.ndim == 0 or array.dtype == object:
            raise pw.errors.PlacementError(
                f"{name} is {'a scalar' if array.ndim == 0 else 'not a numeric array'} "
                f"({type(leaf).__name__} {leaf!r:.60}); expected an array whose first dimension is the batch."
            )
        leaves.append(array)
    sizes = {
        what + jax.tree_util.keystr(path): array.shape[0]
        for (path, _), array in zip(flat, leaves, strict=True)
    }
    if len(set(sizes.values())) > 1:
        raise pw.errors.PlacementError(
            f"the arrays of {what} have different batch sizes (first dimensions): {sizes}; every array "
            "of a batch leads with the same batch dimension."
        )
    if leaves[0].shape[0] == 0:  # a NaN loss, and an optimizer step on zero gradients
        raise pw.errors.PlacementError(
            f"{what} has a batch of 0 examples ({describe(leaves)}); expected at least one: skip "
            "empty batches (e.g. the end of a dataset) before the step."
        )
    return leaves, treedef, leaves[0].shape[0]


def split_tree(
    leaves: list[np.ndarray], treedef: Any, count: int, slices: Any, data_axis: str | None, **kwargs: Any
) -> tuple[Any, ...]:
    """The batch of :func:`batch_leaves` cut into ``count`` pieces, each a pytree like the batch.

    ``kwargs`` are :func:`split_over`'s keywords (for its error).
    """
    pieces = [split_over(leaf, count, slices, data_axis, **kwargs) for leaf in leaves]
    return tuple(treedef.unflatten([piece[i] for piece in pieces]) for i in range(count))


def batch_size(tree: Any) -> int:
    """The batch size of a pytree of batch-leading arrays (its first leaf's first dimension)."""
    return int(np.shape(jax.tree.leaves(tree)[0])[0])


def signature(tree: Any) -> tuple:
    """A hashable key of a pytree of arrays: its structure and every leaf's shape and dtype."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((np.shape(leaf), np.dtype(leaf.dtype)) for leaf in leaves)


def split_over(
    array: np.ndarray,
    count: int,
    slices: Any,
    data_axis: str | None,
    *,
    what: str,
    parts: str,
    per: str,
    place: str,
) -> tuple[np.ndarray, ...]:
    """``array`` cut into ``count`` equal pieces along the batch, each divisible over every slice.

    The caller has checked that ``count`` divides the batch. In the error, ``parts`` names the
    pieces ("shards"), ``per`` what the batch is divided by ("slices") and ``place`` a slice.
    """
    batch = array.shape[0]
    size = batch // count
    for index, slice_ in enumerate(slices):
        axis_size = data_parts(slice_, data_axis)
        if size % axis_size:
            raise pw.errors.PlacementError(
                f"{parts} of {size} examples ({what}: batch {batch} / {count} {per}) "
                f"cannot be split over axis {data_axis!r} of size {axis_size} on {place} {index} "
                f"({slice_!r}); use a batch size that is a multiple of {count * axis_size}."
            )
    return tuple(np.split(array, count))


def abstract(tree: Any) -> Any:
    """ShapeDtypeStructs of a pytree of arrays or futures."""
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), tree)


def describe(tree: Any) -> str:
    leaves = jax.tree.leaves(tree)
    parts = [f"{jax.numpy.dtype(leaf.dtype).name}{list(leaf.shape)}" for leaf in leaves]
    return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"


def _own_streams_key(key: Any) -> Any:
    """The key that reseeds a stage's own streams of a stream whose key the call's ``rngs`` also give."""
    return jax.random.fold_in(key, _OWN_STREAMS)


_OWN_STREAMS = 0x5EED  # folded into the call's keys for the stage's own streams


def sequential(models: Sequence[Any]) -> tuple[tuple[Any, ...], Apply]:
    """Composes stages into one model: ``(params, apply_fn)``, params a tuple per stage.

    The result is the unpipelined model: train it with plain ``jax.jit``, or
    pass it to :class:`DataParallel`. ``apply_fn(params, x, *, rngs=None,
    train=None, train_kw=None)`` runs stage ``j`` with ``train`` (under the
    name the stage takes, see :func:`as_stage`) and with every key of ``rngs``
    folded with ``j`` (``jax.random.fold_in(key, j)``).

    Raises (from ``apply_fn``):
      ProgramTraceError: ``train=True`` and a stage cannot receive it.

    Example:
      >>> import jax.numpy as jnp
      >>> from pathways_jax.pipeline import sequential
      >>> params, apply = sequential([(2.0, lambda p, x: x * p), (1.0, lambda p, x: x + p)])
      >>> apply(params, jnp.ones(2)).tolist()
      [3.0, 3.0]
    """
    stages = as_stages(models)

    def apply(
        params: Sequence[Any],
        x: Any,
        *,
        rngs: Mapping[str, jax.Array] | None = None,
        train: bool | None = None,
        train_kw: str | None = None,
    ) -> Any:
        check_train(stages, train, train_kw, "sequential")
        for j, (stage, p) in enumerate(zip(stages, params, strict=True)):
            keys = {name: jax.random.fold_in(key, j) for name, key in rngs.items()} if rngs else None
            x = stage.run(p, x, keys, train, train_kw)
        return x

    return tuple(stage.params for stage in stages), apply


def _leaf_shape_dtype(leaf: Any) -> tuple[tuple[int, ...], Any]:
    dtype = getattr(leaf, "dtype", None)
    return tuple(np.shape(leaf)), np.dtype(np.asarray(leaf).dtype if dtype is None else dtype)


def checked_state(given: Any, expected: Any, what: str) -> Any:
    """``given`` (a restored checkpoint) in the tree structure of ``expected``, checked leaf by leaf.

    Leaves are matched by their key names (a restored ``nnx.State`` or optimizer state may come
    back as nested dicts and lists), and each must have the expected shape and dtype.

    Raises:
      PlacementError: a leaf is missing, unknown, or of another shape or dtype.
    """
    want = jax.tree_util.tree_flatten_with_path(expected)[0]
    treedef = jax.tree_util.tree_structure(expected)
    try:
        got_flat = jax.tree_util.tree_flatten_with_path(given)[0]
    except Exception as exc:  # pragma: no cover - any object flattens to at least itself
        raise pw.errors.PlacementError(f"{what} is {type(given).__name__}, not a pytree: {exc}") from exc

    def names(path: tuple) -> tuple[str, ...]:
        return tuple(str(part) for part in _path(path))

    got = {names(path): leaf for path, leaf in got_flat}
    wanted = [names(path) for path, _ in want]
    missing = [_show(path) for path in wanted if path not in got]
    unknown = [_show(path) for path in got if path not in set(wanted)]
    if missing or unknown:
        problems = []
        if missing:
            problems.append(f"it lacks {missing[:4]}{' and more' if len(missing) > 4 else ''}")
        if unknown:
            problems.append(
                f"it has {unknown[:4]}{' and more' if len(unknown) > 4 else ''} that the model lacks"
            )
        raise pw.errors.PlacementError(
            f"{what} does not match this model's state ({len(wanted)} arrays): {'; '.join(problems)}. "
            "Restore a checkpoint saved from .state of a model built the same way (the same stages, "
            "optimizer and replicas), with .state of the new model as the restore target."
        )
    leaves = []
    for (_, expected_leaf), key in zip(want, wanted, strict=True):
        leaf = got[key]
        shape, dtype = _leaf_shape_dtype(leaf)
        want_shape, want_dtype = _leaf_shape_dtype(expected_leaf)
        if shape != want_shape or dtype != want_dtype:
            raise pw.errors.PlacementError(
                f"{what}: {_show(key)} is {dtype.name}{list(shape)}, but this model's is "
                f"{want_dtype.name}{list(want_shape)}. Restore a checkpoint of a model built the same "
                "way (the same layer sizes, parameter dtypes and optimizer)."
            )
        leaves.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, leaves)
