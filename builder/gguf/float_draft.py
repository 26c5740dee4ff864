"""A draft made of float weights (a distilled feature draft) on Draftsmith's kernel: every matrix re-quantized into
the kernel's 4-bit blocks by gguf's own quantizer, its embedding the target file's own blocks (GgufGather), never a
float32 copy. Apart from builder.gguf.draft_form (a GGUF draft's form, which builder.gguf.weights reads) because it
writes through builder.gguf.weights: together they were an import circle."""

from __future__ import annotations

import numpy as np

from builder.gguf import weights
from builder.gguf.draft_form import check_requantized, requantized


LAYER_MATRICES = ("qkv", "o", "gate_up", "down")  # builder.decoder.Layer's
REQUANTIZE_ROWS = 8192  # rows quantized (and checked) at a time: a float copy of a whole head at once is a peak


def fits_kernel(decoder, kind: str = "Q4_0") -> str | None:
    """None if every matrix of ``decoder`` (float weights [K, N]) can be ``kind`` blocks (K whole blocks of 32),
    else what cannot."""
    for name, weight in _float_matrices(decoder):
        if weight is None or weight.shape[0] % 32:
            return f"{name} ({'no float weights' if weight is None else f'K = {weight.shape[0]}'})"
    return None


def on_kernel(decoder, gguf, permuted_qk: bool, kind: str = "Q4_0"):
    """``decoder`` (a feature draft's: its own layer and fc, the target's head rows, all float32) for Draftsmith's
    GgufMatMul: every matrix, the fc and the head included, re-quantized into ``kind`` blocks (gguf's quantizer, each
    chunk checked within one quantization step of the float weights by gguf's own dequantization), and its
    embedding the target file's own blocks read by GgufGather (or GatherBlockQuantized where the kernel lacks the
    file's type), after checking that they hold the very table the draft was built with: never a float32 copy.
    ValueError where a matrix does not fit ``kind`` (``fits_kernel``) or the table is not the file's."""
    from builder.decoder import Linear

    wrong = fits_kernel(decoder, kind)
    if wrong is not None:
        raise ValueError(f"{wrong} is not whole {kind} blocks")

    def blocks(name: str, linear: Linear) -> Linear:
        raw = _requantized_float(name, linear.weight, kind)
        return Linear(gguf=weights.gguf_blocks(linear.weight.shape[0], ((kind, raw),)), bias=linear.bias)

    for i, layer in enumerate(decoder.layers):
        for part in LAYER_MATRICES:
            setattr(layer, part, blocks(f"layers.{i}.{part}", getattr(layer, part)))
    decoder.head = blocks("head", decoder.head)
    if decoder.feature_fc is not None:
        decoder.feature_fc = blocks("fc", Linear(decoder.feature_fc))
    weights.file_embedding(decoder, gguf, permuted_qk)
    return decoder


def _float_matrices(decoder):
    """(name, float weight [K, N]) of every matrix a draft of float weights multiplies by."""
    for i, layer in enumerate(decoder.layers):
        for part in LAYER_MATRICES:
            yield f"layers.{i}.{part}", getattr(layer, part).weight
    yield "head", decoder.head.weight
    if decoder.feature_fc is not None:
        yield "fc", decoder.feature_fc


def _requantized_float(name: str, weight: np.ndarray, kind: str) -> np.ndarray:
    """float32 ``weight`` [K, N] as ``kind`` blocks of its N rows, a chunk of rows at a time, each checked."""
    out = []
    for start in range(0, weight.shape[1], REQUANTIZE_ROWS):
        values = np.ascontiguousarray(np.asarray(weight[:, start : start + REQUANTIZE_ROWS], np.float32).T)
        raw = requantized(values, kind)
        check_requantized(name, raw, kind, values)
        out.append(raw)
    return np.concatenate(out) if len(out) > 1 else out[0]
