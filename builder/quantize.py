"""Stage 4: each role's engine file, quantized from what stage 3 exported.

Two ways: ONNX Runtime's MatMulNBits quantizer over the exported graph (``quantize``; the graph is fp32 for CPU
engines and fp16 for CUDA ones, builder.export, and MatMulNBits keeps its float type for activations and scales, so
one function serves both devices), or, for quant gguf, the fused graph written from the GGUF file's own blocks
(builder.gguf.weights), multiplied by Draftsmith's GgufMatMul where its library is built (``native_gguf``) and by
MatMulNBits' exact form elsewhere. ``quantize_engine`` chooses; the kernel a build asks for is checked here before
any work (``check_gguf_kernel``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from builder import graph, memory
from builder.errors import BuildError
from builder.gguf import weights as gguf_weights
from builder.gguf.draft_form import DraftForm
from runtime.bundle import BuildSpec
from runtime.engines import gguf_ops

BITS = {"int8": 8, "int4": 4}


def check_gguf_kernel(spec: BuildSpec) -> None:
    """A build that asks for the native GGUF kernel where its library is not built fails before any work."""
    reason = gguf_ops.unavailable_reason()
    if spec.gguf_kernel == "native" and "gguf" in (spec.target_quant, spec.draft_quant) and reason is not None:
        raise BuildError(f"--gguf-kernel native: {reason}; or build with --gguf-kernel matmulnbits")
    if spec.draft_blocks not in ("file", "auto") and not native_gguf(spec):
        raise BuildError(
            f"draft_blocks {spec.draft_blocks} re-quantizes the draft into blocks of Draftsmith's GGUF kernel, "
            f"which this build does not use ({reason or 'gguf_kernel ' + spec.gguf_kernel}); use draft_blocks file"
        )


def native_gguf(spec: BuildSpec) -> bool:
    """Whether quant gguf engines are written with Draftsmith's GgufMatMul (``spec.gguf_kernel`` resolved here)."""
    return spec.engine_graph == "fused" and gguf_ops.native_for(spec.gguf_kernel)


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


def quantize_engine(
    src: Path,
    dst: Path,
    quant: str,
    spec: BuildSpec,
    checkpoint,
    model,
    layers: int = 0,
    reference: Path | None = None,
    form: DraftForm | None = None,
) -> list[str]:
    """The engine file: ``src`` quantized by ONNX Runtime's quantizer, or (quant gguf) the fused graph written from
    the GGUF file's own blocks (builder.gguf.weights); ``model``: what ``src`` came from (its first ``layers``
    layers; 0: all), whose weights are those of ``checkpoint``. Returns what the engine's graph notes about itself
    (quant gguf: tensors the file holds in a type without an exact MatMulNBits form, the kernel, the draft's
    form). ``reference`` (quant gguf, a path other than ``src``): the same blocks are also written there at
    accuracy level 0 (fp32 arithmetic), what the build report scores the engine against. ``form``: a GGUF draft's
    (builder.gguf.draft_form); its reference keeps the file's blocks (the report then says what a re-quantization
    cost) with the same head rows."""
    if quant != "gguf":
        quantize(src, dst, quant, spec.block_size, spec.symmetric, spec.accuracy_level)
        return []
    if not checkpoint.gguf_file:
        raise BuildError(
            f"quant gguf keeps a GGUF file's own quantized blocks, but {checkpoint.source} is not a "
            ".gguf file; choose int4 or int8"
        )
    if spec.block_size not in (16, gguf_weights.BLOCK):
        raise BuildError(
            f"quant gguf keeps the file's {gguf_weights.BLOCK}-wide blocks (or halves them: block_size "
            f"16); block_size {spec.block_size} would quantize them again"
        )

    native = native_gguf(spec)
    requantized = native and form is not None and form.requantize_to is not None
    said = _kernel_notes(spec, native, requantized) + _form_notes(form)  # what the engine is, before it is written

    def blocks(native: bool):
        decoder = model.decoder(layers)  # a fresh one each time: apply replaces its weights by the file's blocks
        return gguf_weights.apply(
            decoder,
            checkpoint.gguf,
            spec.block_size,
            permuted_qk=checkpoint.architecture.gguf_permuted_qk,
            native=native,
            form=form,
        )

    decoder = blocks(native)
    graph.build(decoder, dst, spec.accuracy_level)
    notes = list(decoder.notes) + said
    if reference is not None and reference not in (src, dst):
        del decoder  # its head and embedding blocks: the reference makes its own
        memory.release()
        graph.build(blocks(False), reference, 0)  # MatMulNBits at accuracy level 0: the file's weights in fp32
    return notes


def _form_notes(form: DraftForm | None) -> list[str]:
    """What the report says about a GGUF draft's form."""
    notes = []
    if form is not None and form.requantize_to:
        notes.append(f"re-quantized from the file's values into {form.requantize_to} blocks (a draft's form)")
    if form is not None and form.head_ids is not None:
        notes.append(f"head over {len(form.head_ids)} target tokens (the bundle's vocab_map)")
    return notes


def _kernel_notes(spec: BuildSpec, native: bool, requantized: bool = False) -> list[str]:
    """What the report says about the kernel that multiplies by the file's blocks (``requantized``: by a draft's
    blocks re-quantized from them, which ``_form_notes`` says)."""
    if native:
        what = "the draft's blocks" if requantized else "the file's blocks as they are"
        return [f"{what}, multiplied by Draftsmith's GgufMatMul ({gguf_ops.kernels()} here)"]
    if spec.gguf_kernel == "auto" and spec.engine_graph == "fused":
        return [
            f"ONNX Runtime's MatMulNBits form (~1.5x the file's bytes a token, slower): {gguf_ops.unavailable_reason()}"
        ]
    return []


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
