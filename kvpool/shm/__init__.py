"""Shared memory a node and its same-host clients both map: the arena (`arena`), its lock-free
key index (`index`, seqlock reads), and flat byte views of callers' buffers (`views`)."""
