"""Bridges between inference engines and the pool: the adapter contract (`base`), the KV handle
passed from prefill to decode (`handle`), the reference model (`model`) and the HuggingFace
transformers adapter (`hf`). Submodules are imported on use so `import engine_adapters` stays
cheap (no torch).
"""
