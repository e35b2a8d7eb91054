"""Host memory: keep the C allocator from holding on to freed device buffers of CPU devices.

On CPU, device buffers are host memory from the C allocator. glibc serves a
large allocation with its own mapping, returned to the system when freed,
but after such a free it raises that size threshold (up to 32 MiB): later
buffers of a few MiB then come from its heaps, where freed space is kept and
fragments. A process that makes and drops buffers of varying sizes (a server
building throw-away programs over constants, say) then grows without bound
although nothing is alive (``benchmarks/soak.py`` measures it). Fixing the
threshold at 1 MiB keeps every buffer of 1 MiB or more in a mapping of its
own, released when freed.

Set ``PATHWAYS_JAX_MALLOC=keep`` to leave the allocator as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

from absl import logging

MMAP_THRESHOLD = 1 << 20  # bytes: buffers at least this large get a mapping of their own
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
_done = False


def release_large_buffers() -> bool:
    """Fixes glibc's mmap threshold at :data:`MMAP_THRESHOLD` (once per process); True if set.

    Does nothing off Linux/glibc, or with ``PATHWAYS_JAX_MALLOC=keep``.
    """
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux") or os.environ.get("PATHWAYS_JAX_MALLOC") == "keep":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        return False
    _done = True
    logging.info("pathways_jax: buffers of %d bytes or more get their own mapping (mallopt)", MMAP_THRESHOLD)
    return True


__all__ = ["MMAP_THRESHOLD", "release_large_buffers"]
