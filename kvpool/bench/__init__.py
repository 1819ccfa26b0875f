"""Benchmark suites behind ``kvpool bench``. Shared timing and reporting live in :mod:`kvpool.bench.timing`."""
