"""Backends: where the devices of a cluster live."""
