"""What two processes of pathways_jax must share to understand each other's messages, and what is
said when they do not: a controller service and a client process joining it, or a controller and a
host actor Ray started on a node of the cluster (whose Python environment may be another).
"""

from __future__ import annotations


def versions() -> dict[str, str]:
    """This process's versions of pathways_jax, of its wire format and of jax (whose exported
    computations the hosts compile)."""
    import jax

    from pathways_jax._src import wire
    from pathways_jax._src.core import version

    return {
        "pathways_jax": version.VERSION,
        "wire": str(wire.WIRE_VERSION),
        "jax": jax.__version__,
    }


def said(have: dict | None) -> str:
    """``have`` (a :func:`versions`; None: from before the check) as words."""
    if have is None:
        return "a pathways_jax older than its version check (before wire format 1)"
    return f"pathways_jax {have.get('pathways_jax')} (wire format {have.get('wire')}, jax {have.get('jax')})"


def _install(want: dict | None) -> str:
    return (
        "" if want is None else f"pip install pathways-jax=={want.get('pathways_jax')} jax=={want.get('jax')}"
    )


def version_mismatch(client: dict | None, service: dict | None) -> str | None:
    """Why a client process of ``client``'s versions cannot join a service of ``service``'s (None:
    they match). ``None`` for either: a version from before the check."""
    if client is not None and service is not None and client == service:
        return None
    wanted = "" if service is None else f"=={service.get('pathways_jax')}"
    jax_wanted = "" if service is None else f" jax=={service.get('jax')}"
    return (
        f"the service runs {said(service)}, this process {said(client)}: "
        "their messages would be misread. Run this process with the service's versions (pip install "
        f"pathways-jax{wanted}{jax_wanted}), or start a service from this process's environment "
        f"(`python -m pathways_jax --name NAME serve ...` there) and join that one"
    )


def host_mismatch(host: int, node: str, theirs: dict | None, mine: dict) -> str | None:
    """Why host actor ``host``, which Ray started on ``node`` with ``theirs`` versions, cannot serve
    this process of ``mine`` (None: they match)."""
    if theirs == mine:
        return None
    return (
        f"host {host} (on node {node}) runs {said(theirs)}, this process {said(mine)}: their messages "
        "would be misread. The host actors run the pathways_jax and jax installed on the node Ray "
        f"starts them on: install this process's on every node of the Ray cluster ({_install(mine)}), "
        "or start this process from the nodes' environment"
    )


def host_unloadable(host: int, why: str, mine: dict) -> str:
    """Why host actor ``host`` did not start where Ray could not load this process's host actor on
    its node (``why``: Ray's last line, such as a method or module it lacks there)."""
    return (
        f"host {host} could not load this process's host actor on its node ({why}): the node has "
        f"another pathways_jax, or none, where this process runs {said(mine)}. The host actors run the "
        "pathways_jax and jax installed on the node Ray starts them on: install this process's on every "
        f"node of the Ray cluster ({_install(mine)}), or start this process from the nodes' environment"
    )


__all__ = ["host_mismatch", "host_unloadable", "said", "version_mismatch", "versions"]
