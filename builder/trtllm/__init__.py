"""TensorRT-LLM builds: the plan, the checkpoint converters, the build itself."""
