"""The engine: TokenSwift and vanilla decoding over our own model runtime, in layers that import downwards only.

`runtime` (model, KV cache, loading, compiled graphs, C++ kernels) ← `generation` (sampling, the decode loop,
text, metrics) ← `tokenswift` (drafting heads, n-gram table, tree, calibration, the step) ← `engine` (composes
them; the registry of decoding methods) ← `tools` (CLI, benchmark, cost curve, head training). pyproject.toml's
import-linter contracts hold the order; tests/test_layers.py runs them.
"""
