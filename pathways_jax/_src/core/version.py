"""The version of pathways_jax (``pathways_jax.__version__``), here for the layers under the public package.

A controller service compares it with each client process's at join, and a controller with each host
actor's at its start (``backends.version_check``).
"""

VERSION = "0.1.0"
