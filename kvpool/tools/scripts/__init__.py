"""Profiling scripts kept because BENCHMARKS.md or docs cite what they measured."""
