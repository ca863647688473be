"""The pool's benchmarks (`kvpool bench store|transfer|pool|serve`; `gpu_check` for `make
gpu-check`): each measures our figure and its baseline in the same run. See `report.py` for the
shared shape (alternating repetitions, median, spread, JSON last line).

Benchmarks that need an engine or start reference workers (adapter, router, policies, disagg)
live with the adapters, in `engine_adapters.bench`; `kvpool.cli.bench` lists them all.
"""
