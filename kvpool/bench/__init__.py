"""Benchmark suites behind ``kvpool bench``; shared timing and reporting: :mod:`kvpool.bench.timing`."""
