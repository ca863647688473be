"""What the router talks to: `reference` (kvpool's own prefill/decode workers) and `vllm` (vLLM
OpenAI servers with kvpool's connector). Each owns its HTTP client and maps its errors."""
