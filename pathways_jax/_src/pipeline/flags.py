"""How a stage takes the ``train`` flag: the keyword its call accepts, read once per class.

A stage's call takes the flag as ``train`` (Flax Linen), ``training`` (nanoGPT) or
``deterministic`` (Flax's Dropout, the opposite sense), or under a name the user gives as
``train_kw=``; a call with ``**kwargs`` gets ``train`` (or the ``train_kw`` name). An NNX
module may instead be switched by its layers' attributes (``module.train()``). A
``train=True`` that no stage keyword and no attribute can carry is an error, never dropped.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from typing import Any

import pathways_jax as pw

# The names a stage's call may take the flag under, in the order they are looked for.
FLAG_NAMES = ("train", "training", "deterministic")
# The name whose value is the opposite of ``train``.
OPPOSITE = "deterministic"


@dataclasses.dataclass(frozen=True, slots=True)
class CallSignature:
    """The keywords a stage's call accepts, as ``inspect.signature`` gives them."""

    owner: str  # the call's qualified name, e.g. "Block.__call__"
    text: str  # its parameters, e.g. "(self, x, training: bool = False)"
    names: frozenset[str]  # the parameters a keyword can reach
    var_keyword: bool  # it takes **kwargs
    required: frozenset[str] = frozenset()  # those of them without a default

    def takes(self, name: str) -> bool:
        return self.var_keyword or name in self.names

    def flag_name(self, train_kw: str | None) -> str | None:
        """The keyword the flag goes in: ``train_kw`` if taken, else a known name, else none."""
        if train_kw is not None and train_kw in self.names:
            return train_kw
        for name in FLAG_NAMES:
            if name in self.names:
                return name
        if self.var_keyword:
            return train_kw or "train"
        return None

    def flag_kwargs(self, train: bool | None, train_kw: str | None) -> dict[str, bool]:
        """The keyword arguments that carry ``train`` (``{}`` for ``None`` or when none is taken)."""
        if train is None:
            return {}
        name = self.flag_name(train_kw)
        if name is None:
            return {}
        return {name: not train if name == OPPOSITE else train}


_UNKNOWN = CallSignature(owner="<call>", text="(...)", names=frozenset(), var_keyword=False)


def _read(fn: Any) -> CallSignature:
    owner = str(getattr(fn, "__qualname__", None) or type(fn).__qualname__)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable without a readable signature
        return dataclasses.replace(_UNKNOWN, owner=owner)
    parameters = signature.parameters.values()
    return CallSignature(
        owner=owner,
        text=str(signature),
        names=frozenset(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)),
        var_keyword=any(p.kind is p.VAR_KEYWORD for p in parameters),
        required=frozenset(
            p.name
            for p in parameters
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty
        ),
    )


# Read signatures by function; weak keys, so a cached apply_fn (and what it closes over)
# is not kept alive by the cache.
_SIGNATURES: weakref.WeakKeyDictionary[Any, CallSignature] = weakref.WeakKeyDictionary()


def signature_of(fn: Any) -> CallSignature:
    """``fn``'s :class:`CallSignature`, read once per function (a class's ``__call__``: once per class)."""
    try:
        return _SIGNATURES[fn]
    except KeyError:
        pass
    except TypeError:  # not weakly referable or not hashable: read it every time
        return _read(fn)
    signature = _SIGNATURES[fn] = _read(fn)
    return signature


def check_train_kw(train_kw: Any, what: str) -> None:
    """Raises ``ProgramTraceError`` unless ``train_kw`` is ``None`` or a keyword name."""
    if train_kw is not None and (not isinstance(train_kw, str) or not train_kw.isidentifier()):
        raise pw.errors.ProgramTraceError(
            f"{what}: train_kw must be the name of the keyword the stages take the train flag "
            f"under (a Python identifier such as 'is_training'), got {type(train_kw).__name__} "
            f"{train_kw!r:.60}."
        )


@dataclasses.dataclass(frozen=True, slots=True)
class TrainFlag:
    """How one stage receives ``train``: a keyword of its call and, for NNX, its layers' attributes.

    ``switched``: an NNX layer has ``deterministic`` or ``use_running_average``, which
    ``set_attributes`` sets from ``train`` (as ``module.train()`` does). ``inert``: an NNX
    module with no such layer, no RNG stream and no ``rngs`` parameter, so ``train`` cannot
    change its output. ``probed``: a Linen module, whose layers are known only when it is
    called (compact children): whether ``train`` could change it is found when its call
    is traced with an input (``stages.linen_holds``), not here.
    """

    signature: CallSignature
    switched: bool = False
    inert: bool = False
    probed: bool = False

    def kwargs(self, train: bool | None, train_kw: str | None) -> dict[str, bool]:
        return self.signature.flag_kwargs(train, train_kw)

    def check(
        self, train: bool | None, train_kw: str | None, *, index: int, description: str, what: str
    ) -> None:
        """Raises if ``train=True`` cannot reach this stage, or ``train=None`` leaves out a flag it requires.

        ``train=False`` is what a stage without a flag does already (evaluation), and
        ``None`` asks for nothing: neither is an error, unless the stage's call has a flag
        parameter without a default (``def __call__(self, x, train: bool)``).
        """
        if train is None:
            name = self.signature.flag_name(train_kw)
            if name is not None and name in self.signature.required:
                raise pw.errors.ProgramTraceError(
                    f"{what}: stage {index} ({description}) requires the flag: "
                    f"{self.signature.owner}{self.signature.text} has no default for {name!r}, and "
                    f"the call gave no train=. Pass train=True to train (dropout on) or train=False "
                    f"to evaluate, e.g. {what}(..., train=True); stage {index} gets it as {name!r}."
                )
            return
        if train is not True or self.switched or self.inert or self.probed:
            return
        if self.signature.flag_name(train_kw) is not None:
            return
        message = self.unreached_message(train_kw, index, description, what=what)
        raise pw.errors.ProgramTraceError(f"{what}: {message}")

    def unreached_message(
        self, train_kw: str | None, index: int, description: str, holds: str = "", what: str = ""
    ) -> str:
        """Why ``train=True`` cannot reach the stage, and what to do.

        ``holds``: what the stage does that a flag would switch (``"calls a linen Dropout at
        Dropout_0"``), found by tracing it;
        ``what``: the call the user made, when known.
        """
        given = f", nor train_kw={train_kw!r}" if train_kw is not None else ""
        to = f" to {what}" if what else ""
        if holds:
            effect = (
                f", while it {holds}, which a flag would switch: the step cannot turn its "
                "training behaviour (dropout, batch statistics) on or off. Give its call a `train` "
                "parameter and pass it on (e.g. linen.Dropout(rate, deterministic=not train)); if it "
                f"takes the flag under another name, pass train_kw='<that name>'{to}; or call with "
                "train=False."
            )
        else:
            effect = (
                ", so its training behaviour (dropout) would stay off. If it takes the flag under "
                f"another name, pass train_kw='<that name>'{to}; else give its call a `train` "
                "parameter, or call with train=False."
            )
        return (
            f"train=True was asked, but stage {index} ({description}) cannot receive it: "
            f"{self.signature.owner}{self.signature.text} takes none of train, training or "
            f"deterministic (the opposite sense){given}{effect}"
        )


class StageRefused(pw.errors.ProgramTraceError):
    """A stage cannot run as the plain model would, found when its call was traced.

    Raised inside the trace, where the caller's name is unknown; the pipelines' checks
    raise it again as ``ProgramTraceError`` with their name in front (see :func:`named`).
    """


class UnreachedFlag(StageRefused):
    """``train=True`` cannot reach a stage, found when its call was traced (a ``probed`` stage)."""


def named(error: StageRefused, what: str) -> pw.errors.ProgramTraceError:
    """``error`` as the ``ProgramTraceError`` of the call ``what`` (e.g. ``"Pipeline.train_step"``)."""
    return pw.errors.ProgramTraceError(f"{what}: {error}")
