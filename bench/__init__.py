"""Benchmarks and load drivers (not imported by the runtime)."""
