"""The TensorRT-LLM runtime: its engines behind the engine contract, and upstream's layouts."""
