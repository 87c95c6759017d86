"""Benchmarks, each runnable as `python -m bench.NAME --json`."""
