"""The engine's tools: the command line, the side-by-side benchmark, the cost curve and head training."""
