"""Benchmarks: `python -m bench.throughput` (see bench/README.md)."""
