"""Stage 4: weight-only quantization of an exported graph (ONNX Runtime's MatMulNBits quantizer).

The graph is fp32 for CPU engines and fp16 for CUDA ones (builder.export); MatMulNBits keeps the graph's float type
for activations and scales, so one function serves both devices.
"""

from __future__ import annotations

import shutil
from pathlib import Path

BITS = {"int8": 8, "int4": 4}


def quantize(
    src: Path, dst: Path, quant: str, block_size: int = 32, symmetric: bool = False, accuracy_level: int = 4
) -> None:
    """Write ``src`` quantized as ``quant`` to ``dst``. fp32 / fp16 copy the graph as exported (with its external
    data, if any).

    int8/int4 replace every MatMul with a constant weight (attention and MLP projections, the output head) by
    MatMulNBits with per-block scales and zero points; the embedding table (a Gather) keeps the graph's float type.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    if quant in ("fp32", "fp16"):
        data = src.with_name(src.name + ".data")
        if not data.exists():
            shutil.copyfile(src, dst)
            return
        _copy_with_external_data(src, dst, data)
        return
    if quant not in BITS:
        raise ValueError(f"unknown quantization {quant!r}; choose fp32 (CPU), fp16 (CUDA), int8 or int4")
    import logging

    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    model = onnx.load(str(src))
    quantizer = MatMulNBitsQuantizer(
        model, bits=BITS[quant], block_size=block_size, is_symmetric=symmetric, accuracy_level=accuracy_level
    )
    quantizer.process()
    large = quantizer.model.model.ByteSize() > 1_800_000_000
    quantizer.model.save_model_to_file(str(dst), use_external_data_format=large)


def _copy_with_external_data(src: Path, dst: Path, data: Path) -> None:
    """``src`` and its external data as ``dst`` + ``dst``.data, the graph's locations renamed to match."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(str(src), load_external_data=False)
    for tensor in model.graph.initializer:
        if uses_external_data(tensor):
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = dst.name + ".data"
    shutil.copyfile(data, dst.with_name(dst.name + ".data"))
    onnx.save_model(model, str(dst))
