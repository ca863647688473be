"""Benchmarks that need a real engine (the reference model, vLLM): run by `kvpool bench <name>`."""
