"""GGUF files: the header read with bounded reads, the blocks as MatMulNBits, layer-by-layer reading."""
