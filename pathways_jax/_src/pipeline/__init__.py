"""Pipelined models and multi-island data parallelism, built only on the public API.

Modules: ``pipelined`` (``Pipeline``); ``data_parallel`` (``DataParallel``); ``diloco`` (``DiLoCo``: islands that sync every k steps); ``stages`` (stages
in one form); ``nodes`` (a stage's ``pw.jit`` nodes); ``schedules`` (pipeline schedules);
``optimizers`` (what counts as an optimizer); ``rngs`` (RNG streams); ``flags`` (the ``train``
flag a stage takes); ``elastic`` (``pw.elastic``: data parallelism through lost islands).
"""
