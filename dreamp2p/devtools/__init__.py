"""Tools for developers and benchmarks that no running node imports."""
