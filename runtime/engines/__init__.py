"""The compiled models: ONNX Runtime engines, their sessions and load-time checks."""
