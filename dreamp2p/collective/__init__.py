"""Collectives over an abstract transport: flat-buffer partitioning and the ring all-reduce."""
