"""What the Ray hosts' failures raise on the controller's side: refusals, lost hosts, remote tracebacks."""

from __future__ import annotations

from typing import Any

from pathways_jax._src.backends.host_link import HostGone
from pathways_jax._src.backends.ray_host import Refused
from pathways_jax._src.core import errors


def with_remote_traceback(exc: BaseException, host: int, trace: str) -> BaseException:
    """Attaches the traceback a host sent with a failure (if any) to ``exc`` as a note."""
    if trace:
        exc.add_note(f"remote traceback (host {host}):\n{trace.rstrip()}")
    return exc


class IteratorEnded(errors.ProgramFailedError):
    """A colocated function raised ``StopIteration`` on a host (its input iterator ran out)."""


def message_failure(answer: Any, host: int, message: str) -> BaseException:
    """The error of a host's failed-message answer (``MessageFailed``), saying ``message``:
    ``IteratorEnded`` where the host's function raised ``StopIteration``; the host's traceback
    as a note."""
    failed = IteratorEnded if getattr(answer, "ended", False) else errors.ProgramFailedError
    return with_remote_traceback(failed(message), host, getattr(answer, "trace", ""))


def ended(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) says a host's colocated function raised ``StopIteration``."""
    while exc is not None:
        if isinstance(exc, IteratorEnded):
            return True
        exc = exc.__cause__
    return False


def refusal(refused: Refused) -> BaseException:
    """The error a controller service's refusal raises here."""
    if refused.kind == "memory":
        return errors.BackPressureTimeout(refused.message)
    if refused.kind == "gone":
        return errors.ClusterError(refused.message)
    if refused.kind == "cancelled":
        return errors.ProgramFailedError(refused.message)
    return errors.AccessError(refused.message)


def is_lost_error(exc: BaseException) -> bool:
    """True if ``exc`` is Ray's way of saying the actor (the host) is gone."""
    import ray.exceptions as rex

    return isinstance(exc, HostGone | rex.RayActorError | rex.ActorDiedError | rex.ActorUnavailableError)
