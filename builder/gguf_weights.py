"""GGUF-faithful weights: a GGUF file's quantized blocks written as ONNX Runtime MatMulNBits, not re-quantized.

Re-quantizing a dequantized Q4_1 file quantizes its weights twice and gives a worse model than the file the user gave
us (SmolLM2: perplexity 24.4 against 16.7). Each GGUF block type below maps exactly onto MatMulNBits (block 32 along
K, one row per output), w = scale * (q - zero_point) [+ offset]:

    Q8_0  w = d * q,        q int8         -> 8 bits, q + 128, zero point 128 (MatMulNBits' 8-bit default)
    Q4_0  w = d * (q - 8),  q 0..15        -> 4 bits, zero point 8 (MatMulNBits' 4-bit default)
    Q4_1  w = d * q + m,    q 0..15        -> 4 bits, zero point 0, plus offsets m: blocksum(x) @ m^T (builder.graph)

Other types are dequantized and quantized again by the build's own quantizer; the build report says which tensors
(``notes``). llama.cpp stores q_proj / k_proj rows permuted for its rotary layout; rows are put back in Hugging Face
order (whole rows move, so blocks stay intact and the mapping stays exact).

Block layouts (ggml-common.h): Q8_0 {fp16 d; int8 qs[32]}; Q4_0 {fp16 d; uint8 qs[16]}; Q4_1 {fp16 d, m; uint8
qs[16]}; a 4-bit block's qs[j] holds element j in its low nibble and element j + 16 in its high nibble.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from builder.graph import BlockQuant, Decoder, Linear

BLOCK = 32
FAITHFUL_TYPES = ("Q8_0", "Q4_0", "Q4_1")
# GGUF tensor name stems for the parts of builder.graph.Layer
PARTS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
         "down": ("ffn_down",)}


def apply(decoder: Decoder, gguf_path: Path, block: int = BLOCK) -> Decoder:
    """``decoder`` (from the dequantized model) with every linear layer the file holds in a faithful type replaced by
    its blocks as they are in the file. Works for a truncated decoder too (its first layers).

    ``block`` 16 writes each 32-block as two 16-blocks with the same scale (still exact): MatMulNBits with int8
    activations (accuracy level 4) quantizes the activations per weight block, so halving the block halves the
    span each activation scale covers."""
    if block not in (16, BLOCK):
        raise ValueError(f"GGUF blocks are {BLOCK} wide; they can be written as {BLOCK} or 16, not {block}")
    import gguf
    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    requantized = []
    for i, layer in enumerate(decoder.layers):
        for part, stems in PARTS.items():
            names = [f"blk.{i}.{stem}.weight" for stem in stems]
            blocks = [_blocks(tensors[n], decoder, stem) for n, stem in zip(names, stems)]
            if len({tensors[n].tensor_type for n in names}) > 1:  # e.g. Q4_K_M's Q6_K v next to Q4_K q, k
                blocks = [None] * len(names)
            if all(b is not None for b in blocks):
                old = getattr(layer, part)
                setattr(layer, part, Linear(quant=split(_stack(blocks), block), bias=old.bias))
            else:
                requantized += [n for n, b in zip(names, blocks) if b is None]
    head = tensors.get("output.weight") or tensors.get("token_embd.weight")
    head_blocks = _blocks(head, decoder, "output") if head is not None else None
    if head_blocks is not None and head_blocks.n == decoder.vocab:
        decoder.head = Linear(quant=split(head_blocks, block))
    elif head is not None:
        requantized.append(head.name)
    if requantized:
        types = sorted({tensors[n].tensor_type.name for n in requantized if n in tensors})
        decoder.notes.append(f"{len(requantized)} tensors of GGUF types {types} have no exact MatMulNBits form; "
                             f"they were dequantized and quantized again: {requantized[:4]}...")
    return decoder


def _blocks(tensor, decoder: Decoder, stem: str) -> BlockQuant | None:
    kind = tensor.tensor_type.name
    if kind not in FAITHFUL_TYPES:
        return None
    n, k = int(tensor.shape[1]), int(tensor.shape[0])  # GGUF shapes list ne0 (K, contiguous) first
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(n, k // BLOCK, -1)
    scales = _half(raw[:, :, 0:2])
    if kind == "Q8_0":
        q = (raw[:, :, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        quant = BlockQuant(8, BLOCK, k, n, np.ascontiguousarray(q), scales)
    else:
        body = raw[:, :, 2:] if kind == "Q4_0" else raw[:, :, 4:]
        elements = np.concatenate([body & 0x0F, body >> 4], axis=-1)  # [N, K/32, 32] in order
        packed = (elements[..., 0::2] | (elements[..., 1::2] << 4)).astype(np.uint8)
        if kind == "Q4_0":
            quant = BlockQuant(4, BLOCK, k, n, packed, scales)
        else:
            zero = np.zeros((n, (k // BLOCK + 1) // 2), np.uint8)
            quant = BlockQuant(4, BLOCK, k, n, packed, scales, zero, _half(raw[:, :, 2:4]))
    if stem in ("attn_q", "attn_k"):
        heads = decoder.heads if stem == "attn_q" else decoder.kv_heads
        quant = _unpermute(quant, heads)
    return quant


def split(quant: BlockQuant, block: int) -> BlockQuant:
    """The same weights in blocks of ``block`` (a divisor of quant.block): each block's elements are contiguous in
    ``packed``, so a block splits by a reshape; every part keeps its block's scale and zero point. Offsets stay per
    original block (their width is K / offsets' columns)."""
    if block == quant.block:
        return quant
    parts = quant.block // block
    n, blocks = quant.n, quant.k // quant.block
    packed = quant.packed.reshape(n, blocks * parts, -1)
    scales = np.repeat(quant.scales, parts, axis=1)
    zero_points = quant.zero_points
    if zero_points is not None:
        if quant.bits != 4 or zero_points.any():
            raise ValueError("only all-zero 4-bit zero points (Q4_1) are split")
        zero_points = np.zeros((n, (blocks * parts + 1) // 2), np.uint8)
    return BlockQuant(quant.bits, block, quant.k, n, np.ascontiguousarray(packed), scales, zero_points, quant.offsets)


def _half(pairs: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(pairs).view(np.float16)[..., 0].astype(np.float32)


def _unpermute(quant: BlockQuant, heads: int) -> BlockQuant:
    """Rows back from llama.cpp's rotary order (per head: pairs interleaved) to Hugging Face's (halves)."""
    head_dim = quant.n // heads

    def rows(a):
        if a is None:
            return None
        return np.ascontiguousarray(a.reshape(heads, head_dim // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape))

    return BlockQuant(quant.bits, quant.block, quant.k, quant.n, rows(quant.packed), rows(quant.scales),
                      rows(quant.zero_points), rows(quant.offsets))


def _stack(blocks: list[BlockQuant]) -> BlockQuant:
    """Projections sharing an input, side by side (more outputs, N summed); they must share bits and layout."""
    first = blocks[0]
    if len(blocks) == 1:
        return first

    def cat(name):
        parts = [getattr(b, name) for b in blocks]
        return None if parts[0] is None else np.concatenate(parts)

    return BlockQuant(first.bits, first.block, first.k, sum(b.n for b in blocks), cat("packed"), cat("scales"),
                      cat("zero_points"), cat("offsets"))
