"""Pipelined models and multi-island data parallelism, built only on the public API."""
