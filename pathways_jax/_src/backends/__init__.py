"""Backends: where the devices of a cluster live, behind one ``Backend`` protocol.

``base`` defines the protocol the controller dispatches through; ``local``
runs steps on this process's JAX devices, ``ray`` sends each host its part
of a run (``ray_host`` is the host side, importing nothing of pathways_jax).
May import: ``compile``, ``ir``, ``core`` (and Ray, lazily, in ``ray``).
"""
