"""Triton repositories for TensorRT-LLM bundles: upstream's interface, layouts and launch."""
