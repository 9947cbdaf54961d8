"""The model runtime: a Llama-family decoder over explicit positions and masks, its KV caches, model loading,
compiled graphs and our C++ CPU kernels. Knows nothing of sampling or drafting."""
