"""Benchmarks behind `dreamp2p bench ...`: each returns a dict the CLI prints as its last JSON line."""
