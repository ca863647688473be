"""FAKE stand-ins for engines that cannot run on this machine (vLLM and SGLang need CUDA).

Everything here is a fake and says so in its name and docstring. The adapters in
`engine_adapters.vllm` and `engine_adapters.sglang` import the real engine classes when the
engine is installed and fall back to these stand-ins only where it is not, so the adapters import
and can be tested on a CPU-only machine. Nothing in here is used when the engine is present.
"""
