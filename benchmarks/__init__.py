"""Reproducible performance scripts (run as modules: ``python -m benchmarks.speedup``)."""
