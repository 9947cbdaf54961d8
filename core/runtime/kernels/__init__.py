"""Our C++ CPU kernels (attention over a long cache, few-row linear layers), built once per machine."""
