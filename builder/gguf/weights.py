"""GGUF-faithful weights: a GGUF file's quantized blocks kept as they are, never re-quantized — for Draftsmith's
GgufMatMul (runtime.engines.gguf_ops: the file's bytes, regrouped 16 rows at a time by ``interleave16``; ``apply(...,
native=True)``), or written as ONNX Runtime MatMulNBits, exactly, where that library is not built or a type has no
kernel of ours.

Re-quantizing a dequantized Q4_1 file quantizes its weights twice and gives a worse model than the file the user gave
us (SmolLM2: perplexity 24.4 against 16.7). Each GGUF block type below maps exactly onto MatMulNBits (one row per
output, blocks along K), w = scale * (q - zero_point) [+ offset], the offset applied as blocksum(x) @ offsets^T
(builder.graph; offset blocks 16 or 32 wide). MatMulNBits (onnxruntime 1.32) takes 2, 4 or 8 bits, so 5- and 6-bit types
are stored as 8 bits (on this CPU small layers cost the same at 8 bits; shared/FACTS.md):

    type  bytes per block (ggml-common.h)                      w                          MatMulNBits form
    Q8_0  {fp16 d; int8 qs[32]}                                d * q                      8-bit/32
    Q4_0  {fp16 d; u8 qs[16]}                                  d * (q - 8)                4-bit/32 (zero point 8)
    Q4_1  {fp16 d, m; u8 qs[16]}                               d * q + m                  4-bit/32, zp 0, offsets m
    Q5_0  {fp16 d; u8 qh[4]; u8 qs[16]}                        d * (q - 16)               8-bit/32
    Q5_1  {fp16 d, m; u8 qh[4]; u8 qs[16]}                     d * q + m                  8-bit/32, offsets m
    Q4_K  {fp16 d, dmin; u8 scales[12]; u8 qs[128]}            d*sc * q - dmin*mn         4-bit/32, zp 0, offsets
    Q5_K  {fp16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]} d*sc * q - dmin*mn         8-bit/32, offsets
    Q6_K  {u8 ql[128]; u8 qh[64]; int8 scales[16]; fp16 d}     d*sc * (q - 32)            8-bit/16
    Q2_K  {u8 scales[16]; u8 qs[64]; fp16 d, dmin}             d*sc * q - dmin*mn, q 0..3 4-bit/16, offsets /16
    Q3_K  {u8 hmask[32]; u8 qs[64]; u8 scales[12]; fp16 d}     d*(sc-32) * q, q -4..3     4-bit/16
    IQ4_NL {fp16 d; u8 qs[16]}                                 d * grid[q]                8-bit/32
    IQ4_XS {fp16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]}  d*(ls-32) * grid[q]        8-bit/32

8-bit values are stored as q - zero_point + 128 under MatMulNBits' default zero point (128), so no 8-bit type needs
a zero-point input; 4-bit ones whose q - zero_point lies in -8..7 (Q4_0, Q2_K, Q3_K) neither. The K-quants are
256-wide super-blocks: Q4_K / Q5_K have 8 sub-blocks of 32 with 6-bit scales sc and mins mn packed in ``scales[12]``,
Q6_K 16 sub-blocks of 16 with int8 scales, Q2_K / Q3_K 16 of 16 with 4-bit / 6-bit ones. IQ4_NL / IQ4_XS index a
16-entry grid of int8 values (ggml-common.h kvalues_iq4nl), so the grid value is the 8-bit q. Scales d*sc and offsets
dmin*mn are exact in float32 (an fp16 times a small integer), so with fp32 activations the product is the file's, up
to summation order.

Sources relied on: ggml's ``ggml/src/ggml-common.h`` (ggml-org/llama.cpp; structs block_q8_0, block_q4_0,
block_q4_1, block_q5_0, block_q5_1, block_q2_K ... block_q6_K, block_iq4_nl, block_iq4_xs) and ``ggml-quants.c``
(dequantize_row_q2_K ... q6_K, iq4_nl, iq4_xs; get_scale_min_k4); the element order was checked against the
``gguf`` package's ``gguf/quants.py`` (0.19.0) dequantizers, the oracle of tests/test_gguf_types.py.

Projections fused into one MatMulNBits (q|k|v, gate|up) whose parts have different types (Q4_K_M: Q6_K attn_v next
to Q4_K attn_q/attn_k) are promoted to a common exact form: the widest bits, the smallest block, offsets zero-filled
for parts without them. Other types (the grid IQ types, TQ*, MXFP4, floats) stay float32 weights dequantized from
the file (exact, but larger and slower); ``Decoder.notes`` says which tensors. llama.cpp's converter stores q_proj /
k_proj rows permuted for its rotary layout for Llama-style architectures only (``permuted_qk``); rows are put back in
Hugging Face order (whole rows move, so blocks stay intact and the mapping stays exact). Every layer is checked against
the float weights transformers dequantized from the same file before it replaces them.

Longer than most modules: one decoder per GGUF block type, each a few lines against ggml's layout, and the packing
they share; split apart they would only import one another.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from builder.decoder import BlockQuant, Decoder, GgufBlocks, LazyLayers, Linear
from builder.gguf import draft_form
from builder.gguf.draft_form import DraftForm
from builder.gguf.header import GgufFile
from runtime.engines import gguf_ops

BLOCK = 32
# GGUF tensor name stems for the parts of builder.decoder.Layer, first choice first (Phi-3's converter writes q|k|v as
# one attn_qkv and gate|up as one ffn_up)
PARTS = {
    "qkv": (("attn_q", "attn_k", "attn_v"), ("attn_qkv",)),
    "o": (("attn_output",),),
    "gate_up": (("ffn_gate", "ffn_up"), ("ffn_up",)),
    "down": (("ffn_down",),),
}
ROW_CHUNK = 8192  # rows dequantized at a time by the check against the model


@dataclass(frozen=True)
class _Blocks:
    """Unpacked blocks: w[n, j*b + i] = scales[n, j] * (q[n, j, i] - zero[n, j]) + offsets[n, (j*b + i) // o].

    ``q`` uint8 [N, K/b, b]; ``zero`` uint8 [N, K/b]; ``scales`` float32 [N, K/b]; ``offsets`` float32 [N, K/o]
    (o = 16 or 32, a multiple of b) or None; ``bits``: what MatMulNBits needs to store q - zero (4 or 8)."""

    bits: int
    q: np.ndarray
    zero: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None = None

    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def block(self) -> int:
        return self.q.shape[2]

    @property
    def k(self) -> int:
        return self.q.shape[1] * self.q.shape[2]


def apply(
    decoder: Decoder,
    gguf: GgufFile,
    block: int = BLOCK,
    permuted_qk: bool = True,
    native: bool = False,
    form: DraftForm | None = None,
) -> Decoder:
    """``decoder`` (from the dequantized model) with every linear layer ``gguf`` holds in a faithful type replaced by
    its blocks as they are in the file. Works for a truncated decoder too (its first layers). Each replaced layer is
    first checked against the decoder's own float weights (which transformers dequantized from the same file): a
    file whose blocks say something else is refused (ValueError) rather than built.

    Args:
        native: layers (and the head) whose every part has a type Draftsmith's GgufMatMul multiplies
            (runtime.engines.gguf_ops.GGML_TYPE_IDS) keep the file's bytes as they are (``Linear.gguf``: ~4.5 bits a
            Q4_K weight, 6.56 a Q6_K one) instead of MatMulNBits' form (6 and 10 bits); the others take MatMulNBits.
        block: 16 writes each 32-block of the layers as two 16-blocks with the same scale (still exact):
            MatMulNBits with int8 activations (accuracy level 4) quantizes the activations per weight block, so
            halving the block halves the span each activation scale covers. Q6_K's blocks are 16 wide either way.
            The head keeps the file's blocks: it reads the final hidden state alone, and on Gemma 3 270M halving its
            blocks moved top-1 agreement by 0.001 over 27,485 tokens (0.9535 → 0.9547) while its call, bandwidth-
            bound on a 262,144-row 8-bit matrix, grew ~15%.
        permuted_qk: whether the file's attn_q / attn_k rows are in llama.cpp's rotary order. llama.cpp's
            convert_hf_to_gguf.py permutes them in LlamaModel.modify_tensors (Llama, Mistral and the classes built on
            LlamaModel), not for Qwen2/Qwen3, Gemma 2/3 or Phi-3 (NEOX rotary): the caller knows the architecture
            (builder.architectures.Architecture.gguf_permuted_qk). Where the check shows the other order, that one
            is used and ``decoder.notes`` says so (the registry entry is wrong).
        form: a draft's form (builder.gguf.draft_form): its head cut to the kept ids' rows (``decoder.vocab``
            becomes their number), and, with ``native``, every layer, the head and the embedding re-quantized into
            the form's block type from the file's values (each checked against the model's float weights first).
    """
    form = form or DraftForm()
    requant = form.requantize_to if native else None
    if block not in (16, BLOCK):
        raise ValueError(f"GGUF blocks are {BLOCK} wide; they can be written as {BLOCK} or 16, not {block}")
    tensors = gguf.tensors  # the header as builder.checkpoint walked and checked it
    data = FileBytes(gguf.path)
    kept = [
        n
        for i in range(len(decoder.layers))
        for names, _ in _layer_parts(tensors, i).values()
        for n in names
        if n not in tensors or tensors[n].kind not in DECODERS
    ]  # left as float weights

    def with_blocks(i: int, layer):
        for part, (names, stems) in _layer_parts(tensors, i).items():
            old = getattr(layer, part)
            linear, order = _part(data, tensors, decoder, names, stems, old, permuted_qk, block, native, requant)
            if linear is not None:
                setattr(layer, part, linear)
            if linear is not None and order != permuted_qk and not any(FLIPPED in n for n in decoder.notes):
                decoder.notes.append(
                    f"the file's attn_q / attn_k rows are {'not ' if permuted_qk else ''}{FLIPPED}, unlike what "
                    f"Architecture.gguf_permuted_qk ({permuted_qk}) says for this architecture; they were read in "
                    "the order that matches the model: fix the registry entry"
                )
        return layer

    if isinstance(decoder.layers, LazyLayers):  # made as the graph is written, one layer at a time
        decoder.layers = decoder.layers.map(with_blocks)
    else:
        decoder.layers = [with_blocks(i, layer) for i, layer in enumerate(decoder.layers)]
    head = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if not _head(decoder, data, head, permuted_qk, native, form.head_ids, requant) and head is not None:
        kept.append(head.name)
    _embedding(decoder, data, tensors, permuted_qk, native, requant, tied_ok=form.head_ids is None)
    _note(decoder, tensors, kept)
    return decoder


def _head(decoder: Decoder, data, head, permuted_qk: bool, native: bool, ids, requant: str | None) -> bool:
    """The head as the file's blocks (only the rows of ``ids`` where given; ``decoder.vocab`` then their number),
    checked against the model's float head; False where it stays float weights (those rows of them)."""
    blocks = _tensor_blocks(data, head, decoder, "output", permuted_qk)
    whole = blocks is not None and (blocks.n, blocks.k) == (decoder.vocab, decoder.hidden)
    if ids is not None:
        weight = decoder.head.weight
        decoder.vocab = len(ids)
        decoder.head = Linear(weight=None if weight is None else np.ascontiguousarray(weight[:, ids]))
        blocks = _rows(blocks, ids) if whole else None
    if not whole:
        return False
    _same_as_model(head.name, blocks, decoder.head.weight, "head")
    if native and (requant or head.kind in gguf_ops.GGML_TYPE_IDS):
        if requant:
            raw, kind = _requantized(head.name, blocks, requant), requant
        else:
            raw, kind = _raw_rows(data, head, decoder, "output", permuted_qk), head.kind
            raw = raw if ids is None else np.ascontiguousarray(raw[ids])
        decoder.head = Linear(gguf=gguf_blocks(blocks.k, ((kind, raw),)))
    else:
        decoder.head = Linear(quant=_pack(split(blocks, BLOCK)))
    return True


def _rows(blocks: _Blocks, ids) -> _Blocks:
    """The blocks of rows ``ids`` only (a reduced head)."""
    return _Blocks(
        blocks.bits,
        blocks.q[ids],
        blocks.zero[ids],
        blocks.scales[ids],
        None if blocks.offsets is None else blocks.offsets[ids],
    )


def _requantized(name: str, blocks: _Blocks, kind: str) -> np.ndarray:
    """``blocks``' values re-quantized into GGUF blocks of ``kind`` (builder.gguf.draft_form), a row chunk at a
    time (a 151,936-row head's float copy at once would be a build's peak), each chunk checked."""
    out = []
    for start in range(0, blocks.n, ROW_CHUNK):
        values = _dequantized(blocks, start, start + ROW_CHUNK)
        raw = draft_form.requantized(values, kind)
        draft_form.check_requantized(name, raw, kind, values)
        out.append(raw)
    return np.concatenate(out) if len(out) > 1 else out[0]


def _embedding(
    decoder: Decoder,
    data,
    tensors: dict,
    permuted_qk: bool,
    native: bool = False,
    requant: str | None = None,
    tied_ok: bool = True,
) -> None:
    """The embedding as the file's own blocks, checked like every layer against the float table transformers
    dequantized from the same file: read by GgufGather from the file's bytes (``native`` and a type it knows; a
    tied head's very bytes where the file has no output.weight), else GatherBlockQuantized (builder.graph). It stays
    float32 where the file's type has no exact form or the table's shape is not the file's."""
    tensor = tensors.get("token_embd.weight")
    blocks = _tensor_blocks(data, tensor, decoder, "token_embd", permuted_qk)
    if blocks is None or (blocks.n, blocks.k) != tuple(decoder.embedding.shape) or blocks.block < 16:
        return
    _same_as_model(tensor.name, blocks, decoder.embedding.T, "embedding")
    if native and (requant or tensor.kind in gguf_ops.GGML_TYPE_IDS):
        head = decoder.head.gguf
        kind = requant or tensor.kind
        tied = tied_ok and "output.weight" not in tensors and head is not None and head.parts[0][0] == kind
        if tied:
            decoder.embedding_gguf = head
        elif requant:
            decoder.embedding_gguf = GgufBlocks(blocks.k, ((kind, _requantized(tensor.name, blocks, kind)),))
        else:
            rows = _raw_rows(data, tensor, decoder, "token_embd", permuted_qk)
            decoder.embedding_gguf = GgufBlocks(blocks.k, ((kind, rows),))
        return
    decoder.embedding_quant = _pack(blocks)


FLIPPED = "in llama.cpp's rotary order"


class FileBytes:
    """A file's bytes read when sliced (``pread``), not mapped: every page a mapping touches stays in the process's
    resident set until it is unmapped, so reading a 1.1 GB file through one made a build's RSS grow by the file
    (twice where two mappings read it), although none of it was still needed."""

    def __init__(self, path: Path):
        import os

        self._fd = os.open(path, os.O_RDONLY)

    def __getitem__(self, span: slice) -> np.ndarray:
        import os

        length = span.stop - span.start
        chunk = os.pread(self._fd, length, span.start)
        if len(chunk) != length:
            raise ValueError(f"the file ends inside a tensor (bytes {span.start}..{span.stop})")
        return np.frombuffer(chunk, np.uint8)

    def __del__(self):
        import os

        try:
            os.close(self._fd)
        except (AttributeError, OSError):
            pass


def _layer_parts(tensors: dict, i: int) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    """{Layer field: (GGUF tensor names, their stems)} of layer ``i``, the first naming the file holds."""
    parts = {}
    for part, choices in PARTS.items():
        stems = next((c for c in choices if all(f"blk.{i}.{s}.weight" in tensors for s in c)), choices[0])
        parts[part] = ([f"blk.{i}.{stem}.weight" for stem in stems], stems)
    return parts


def _part(
    data,
    tensors: dict,
    decoder: Decoder,
    names: list[str],
    stems: tuple[str, ...],
    old: Linear,
    permuted_qk: bool,
    block: int,
    native: bool = False,
    requant: str | None = None,
) -> tuple[Linear | None, bool]:
    """One fused projection from the file's blocks, checked against ``old`` (the model's float weights), and the q/k
    row order that matched; (None, _) where a part has no exact form. ``native``: the file's own bytes
    (``Linear.gguf``) where every part's type allows it; ``requant``: each part re-quantized into that type."""
    orders = (permuted_qk, not permuted_qk) if "attn_q" in stems else (permuted_qk,)
    for order in orders:
        blocks = [_tensor_blocks(data, tensors.get(n), decoder, stem, order) for n, stem in zip(names, stems)]
        if any(b is None for b in blocks):
            return None, order
        stacked = _stack(blocks)
        error = _mismatch(", ".join(names), stacked, old.weight)
        if error is None and requant:
            raw = tuple((requant, _requantized(n, b, requant)) for n, b in zip(names, blocks))
            return Linear(gguf=gguf_blocks(stacked.k, raw), bias=old.bias), order
        if error is None and native and all(tensors[n].kind in gguf_ops.GGML_TYPE_IDS for n in names):
            raw = tuple(
                (tensors[n].kind, _raw_rows(data, tensors[n], decoder, stem, order)) for n, stem in zip(names, stems)
            )
            return Linear(gguf=gguf_blocks(stacked.k, raw), bias=old.bias), order
        if error is None:
            return Linear(quant=_pack(split(stacked, block)), bias=old.bias), order
    raise ValueError(
        f"{', '.join(names)}: the file's blocks differ from the weights transformers loaded from the "
        f"same file (max |difference| {error:.3g}{', in either q/k row order' if len(orders) > 1 else ''})"
        "; the file is inconsistent"
    )


def _note(decoder: Decoder, tensors: dict, kept: list[str]) -> None:
    if kept:
        types = sorted({tensors[n].kind for n in kept if n in tensors})
        missing = [n for n in kept if n not in tensors]
        decoder.notes.append(
            f"{len(kept)} tensors have no exact MatMulNBits form (GGUF types {types}"
            f"{f', {len(missing)} not in the file' if missing else ''}); they stay float32 weights dequantized from "
            f"the file (exact, but larger and slower): {kept[:4]}..."
        )


def _same_as_model(name: str, blocks: _Blocks, weight: np.ndarray | None, what: str) -> None:
    """ValueError unless the file's blocks of ``name`` say what the model transformers loaded from the same file
    holds as its ``what``."""
    error = _mismatch(name, blocks, weight)
    if error is not None:
        raise ValueError(
            f"{name}: the file's blocks differ from the {what} transformers loaded from the same file (max "
            f"|difference| {error:.3g}); the file is inconsistent"
        )


def _mismatch(names: str, blocks: _Blocks, weight: np.ndarray | None) -> float | None:
    """None if the blocks say what the decoder's float weights [K, N] say (both are the file dequantized in float32:
    equal up to rounding), else the largest difference. A different shape is an error."""
    if weight is None:
        return None
    if tuple(weight.shape) != (blocks.k, blocks.n):
        raise ValueError(
            f"{names}: the GGUF file holds [K={blocks.k}, N={blocks.n}] but the model loaded from it "
            f"has {list(weight.shape)}; the file is inconsistent"
        )
    rows = weight.T
    for start in range(0, blocks.n, ROW_CHUNK):
        want = rows[start : start + ROW_CHUNK]
        error = float(np.abs(_dequantized(blocks, start, start + ROW_CHUNK) - want).max(initial=0.0))
        if not error <= 1e-5 * max(float(np.abs(want).max(initial=0.0)), 1e-30):
            return error
    return None


def _dequantized(blocks: _Blocks, start: int, stop: int) -> np.ndarray:
    """float32 [rows, K] of rows start:stop."""
    q = blocks.q[start:stop].astype(np.float32) - blocks.zero[start:stop, :, None]
    w = (q * blocks.scales[start:stop, :, None]).reshape(-1, blocks.k)
    if blocks.offsets is not None:
        w += np.repeat(blocks.offsets[start:stop], blocks.k // blocks.offsets.shape[1], axis=1)
    return w


# --- one tensor's blocks ---------------------------------------------------------------------------------------------


def _tensor_blocks(data: np.ndarray, tensor, decoder: Decoder, stem: str, permuted_qk: bool) -> _Blocks | None:
    """The blocks of ``tensor`` (a gguf_header.TensorInfo; its bytes in ``data``, the mapped file), in Hugging Face
    row order; None for a missing tensor or a type without an exact form."""
    if tensor is None or tensor.kind not in DECODERS:
        return None
    import gguf

    elements, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[tensor.kind]]
    if len(tensor.shape) != 2:
        raise ValueError(f"{tensor.name}: a {tensor.kind} weight must be 2-D, not shape {list(tensor.shape)}")
    k, n = tensor.shape  # GGUF shapes list ne0 (K, contiguous) first; the header check made K whole blocks
    blocks = _decoded_rows(data, tensor, n, k // elements, size)
    if permuted_qk and stem in ("attn_q", "attn_k"):
        heads = decoder.heads if stem == "attn_q" else decoder.kv_heads
        if n % (2 * heads):
            raise ValueError(f"{tensor.name}: {n} rows are not {heads} heads of an even size")
        blocks = _unpermute(blocks, heads)
    return blocks


def _raw_rows(data, tensor, decoder: Decoder, stem: str, permuted_qk: bool) -> np.ndarray:
    """The tensor's bytes as the file holds them, uint8 [N, bytes a row], rows in Hugging Face order (llama.cpp's
    rotary order undone for attn_q / attn_k: whole rows move, the blocks inside them are untouched)."""
    n = tensor.shape[1]
    rows = np.asarray(data[tensor.start : tensor.start + tensor.nbytes]).reshape(n, tensor.nbytes // n)
    if permuted_qk and stem in ("attn_q", "attn_k"):
        heads = decoder.heads if stem == "attn_q" else decoder.kv_heads
        return _rows_unpermuted(rows, heads)
    return rows


def gguf_blocks(k: int, parts: tuple[tuple[str, np.ndarray], ...]) -> GgufBlocks:
    """The file's rows for GgufMatMul, regrouped for its column kernels (layout 1: 16 outputs a vector, a few times
    cheaper per extra row of a call than reading rows one by one) where every part's rows come in groups of 16."""
    if all(len(data) % 16 == 0 for _, data in parts):
        return GgufBlocks(k, tuple((kind, interleave16(kind, data)) for kind, data in parts), layout=1)
    return GgufBlocks(k, parts)


def interleave16(kind: str, rows: np.ndarray) -> np.ndarray:
    """The file's rows [N, bytes a row] (N a multiple of 16) in GgufMatMul's column layout (layout 1): for each group
    of 16 rows and each block, the 16 rows' fp16 scales side by side, their packed scale bytes and quant bytes four
    at a time row after row (planes and quads), Q5_0's high bits as 64-bit words per four values
    (runtime/engines/gguf_ops/src/x16_layout.h has the table). The same bytes in another order, viewed as [N,
    bytes a row]: a regrouping, exact and no larger."""
    elements, size = gguf_ops.BLOCK_SHAPES[kind]
    n, row_bytes = rows.shape
    b = rows.reshape(n // 16, 16, row_bytes // size, size).transpose(0, 2, 1, 3)  # [groups, blocks, 16 rows, size]

    def side_by_side(lo: int, hi: int) -> np.ndarray:  # a field of each row, rows one after another
        return b[..., lo:hi].reshape(*b.shape[:2], -1)

    def quads(lo: int, hi: int) -> np.ndarray:  # bytes lo..hi of each row, four at a time, rows side by side
        x = b[..., lo:hi]
        return x.reshape(*x.shape[:3], -1, 4).transpose(0, 1, 3, 2, 4).reshape(*b.shape[:2], -1)

    def q6_stream() -> np.ndarray:  # Q6_K's quant bytes in reading order: per half and t, two ql quads, a qh quad
        groups, blocks = b.shape[:2]
        ql = quads(0, 128).reshape(groups, blocks, 2, 2, 8, 64).transpose(0, 1, 2, 4, 3, 5)  # [h, t, odd]
        qh = quads(128, 192).reshape(groups, blocks, 2, 8, 1, 64)
        return np.concatenate([ql, qh], axis=4).reshape(groups, blocks, -1)

    def high_bit_words(lo: int) -> np.ndarray:  # Q5_0's qh: word e, bit 4c + j = row c's bit of value 4e + j
        bits = np.unpackbits(b[..., lo : lo + 4], axis=-1, bitorder="little")  # [g, blocks, 16, 32]
        bits = bits.reshape(*bits.shape[:3], 8, 4).transpose(0, 1, 3, 2, 4).reshape(*b.shape[:2], 8, 64)
        return np.packbits(bits, axis=-1, bitorder="little").reshape(*b.shape[:2], -1)

    fields = {
        "Q8_0": lambda: [side_by_side(0, 2), quads(2, 34)],
        "Q4_0": lambda: [side_by_side(0, 2), quads(2, 18)],
        "Q4_1": lambda: [side_by_side(0, 2), side_by_side(2, 4), quads(4, 20)],
        "Q5_0": lambda: [side_by_side(0, 2), high_bit_words(2), quads(6, 22)],
        "Q4_K": lambda: [side_by_side(0, 2), side_by_side(2, 4), quads(4, 16), quads(16, 144)],
        "Q6_K": lambda: [side_by_side(208, 210), quads(192, 208), q6_stream()],
    }[kind]()
    out = np.concatenate(fields, axis=-1)
    assert out.shape[-1] == 16 * size and elements in (32, 256)
    return np.ascontiguousarray(out).reshape(n, row_bytes)


def _rows_unpermuted(rows: np.ndarray, heads: int) -> np.ndarray:
    """Rows [N, ...] back from llama.cpp's rotary order (per head: pairs interleaved) to Hugging Face's (halves)."""
    pairs = rows.reshape(heads, len(rows) // heads // 2, 2, *rows.shape[1:])
    return np.ascontiguousarray(pairs.swapaxes(1, 2).reshape(rows.shape))


DECODE_ROWS = 8192  # rows read and unpacked at a time (a 151,936-row table's unpacking temporaries: 1/19 of them)


def _decoded_rows(data, tensor, n: int, blocks: int, size: int) -> _Blocks:
    """The tensor's blocks, read and unpacked DECODE_ROWS rows at a time into arrays made once: unpacking a whole
    embedding at once made temporaries of several times its size (Q5_0's bit planes), a build's peak."""
    row_bytes = blocks * size
    out = None
    for start in range(0, n, DECODE_ROWS):
        rows = min(DECODE_ROWS, n - start)
        offset = tensor.start + start * row_bytes
        part = DECODERS[tensor.kind](np.asarray(data[offset : offset + rows * row_bytes]).reshape(rows, blocks, size))
        if out is None:
            if rows == n:
                return part
            out = {
                key: None if value is None else np.empty((n, *value.shape[1:]), value.dtype)
                for key, value in vars(part).items()
                if key != "bits"
            }
        for key, array in out.items():
            if array is not None:
                array[start : start + rows] = getattr(part, key)
    return _Blocks(part.bits, **out)


def _half(pairs: np.ndarray) -> np.ndarray:
    """fp16 values from their two little-endian bytes (the last axis), as float32."""
    return np.ascontiguousarray(pairs).view("<f2")[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 32 elements] from [..., 16 bytes]: element j in byte j's low nibble, element j + 16 in its high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bit(qh: np.ndarray) -> np.ndarray:
    """[..., 32] bit j of the little-endian 32-bit word in qh [..., 4], as 16 or 0 (Q5_0 / Q5_1's high bit)."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # [..., 32], bit j of byte j // 8 at j
    return bits << 4


def _full(shape, value: int) -> np.ndarray:
    return np.full(shape, value, np.uint8)


def _q8_0(raw):
    q = raw[..., 2:] ^ np.uint8(0x80)  # int8 q + 128 as uint8
    return _Blocks(8, q, _full(q.shape[:2], 128), _half(raw[..., 0:2]))


def _q4_0(raw):
    q = _nibbles(raw[..., 2:18])
    return _Blocks(4, q, _full(q.shape[:2], 8), _half(raw[..., 0:2]))


def _q4_1(raw):
    q = _nibbles(raw[..., 4:20])
    return _Blocks(4, q, _full(q.shape[:2], 0), _half(raw[..., 0:2]), _half(raw[..., 2:4]))


def _q5_0(raw):
    q = _nibbles(raw[..., 6:22]) | _fifth_bit(raw[..., 2:6])
    return _Blocks(8, q, _full(q.shape[:2], 16), _half(raw[..., 0:2]))


def _q5_1(raw):
    q = _nibbles(raw[..., 8:24]) | _fifth_bit(raw[..., 4:8])
    return _Blocks(8, q, _full(q.shape[:2], 0), _half(raw[..., 0:2]), _half(raw[..., 2:4]))


def _scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 8 six-bit scales and mins from 12 bytes [..., 12] (ggml-quants.c get_scale_min_k4): sub-blocks
    0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in the nibbles of bytes 8-11 (low: scale, high:
    min), their top 2 bits in the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mins = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: [N, S, 8, 32] from qs [N, S, 128]: each 32 bytes hold sub-block 2c (low nibbles) and 2c+1
    (high nibbles)."""
    chunks = qs.reshape(*qs.shape[:2], 4, 1, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=3).reshape(*qs.shape[:2], 8, 32)


def _k_scales(raw, q: np.ndarray, bits: int) -> _Blocks:
    """Q4_K / Q5_K: d*sc per 32-block, offsets -dmin*mn; q [N, S, 8, 32]."""
    d, dmin = _half(raw[..., 0:2])[..., None], _half(raw[..., 2:4])[..., None]
    scales, mins = _scale_min(raw[..., 4:16])
    n = q.shape[0]
    q = q.reshape(n, -1, 32)
    return _Blocks(bits, q, _full(q.shape[:2], 0), (d * scales).reshape(n, -1), (-(dmin * mins)).reshape(n, -1))


def _q4_k(raw):
    return _k_scales(raw, _k_low_nibbles(raw[..., 16:144]), 4)


def _q5_k(raw):
    high = np.unpackbits(raw[..., 16:48, None], axis=-1, bitorder="little")  # [N, S, 32 bytes, 8]: bit s -> sub s
    return _k_scales(raw, _k_low_nibbles(raw[..., 48:176]) | (np.moveaxis(high, -1, -2) << 4), 8)


def _q6_k(raw):
    """Two halves of 128: in half h, group g (of 32) takes its low 4 bits from ql[64h + 32(g % 2) + i] (low nibble
    for g < 2, high for g >= 2) and its high 2 bits from bits 2g, 2g+1 of qh[32h + i]; 16 scales of 16 each."""
    n, s = raw.shape[:2]
    ql = raw[..., 0:128].reshape(n, s, 2, 1, 2, 32)  # [half, -, g % 2, i]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3).reshape(n, s, 2, 4, 32)  # g = 2 * (nibble) + g % 2
    qh = raw[..., 128:192].reshape(n, s, 2, 1, 32)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 0x03  # [half, g, i]
    q = (low | (high << 4)).reshape(n, s * 16, 16)
    scales = raw[..., 192:208].view(np.int8).astype(np.float32) * _half(raw[..., 208:210])[..., None]
    return _Blocks(8, q, _full(q.shape[:2], 32), scales.reshape(n, -1))


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K's 2-bit values [N, S, 256] from qs [N, S, 64]: in half h (128 values), group g (of 32) is bits
    2g, 2g+1 of qs[32h + i]."""
    n, s = qs.shape[:2]
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
    return ((qs.reshape(n, s, 2, 1, 32) >> shifts) & 0x03).reshape(n, s, 256)


def _q2_k(raw):
    """{u8 scales[16]; u8 qs[64]; fp16 d, dmin}: w = d*(sc & 15) * q - dmin*(sc >> 4) per 16, q 0..3, stored as
    q + 8 under the 4-bit default zero point; offsets 16 wide."""
    n = raw.shape[0]
    q = _crumbs(raw[..., 16:80]).reshape(n, -1, 16) + np.uint8(8)
    d, dmin = _half(raw[..., 80:82])[..., None], _half(raw[..., 82:84])[..., None]
    scales = (d * (raw[..., 0:16] & 0x0F)).reshape(n, -1)
    return _Blocks(4, q, _full(q.shape[:2], 8), scales, (-(dmin * (raw[..., 0:16] >> 4))).reshape(n, -1))


def _q3_k(raw):
    """{u8 hmask[32]; u8 qs[64]; u8 scales[12]; fp16 d}: w = d*(sc - 32) * q per 16, q = low 2 bits - 4 where the
    hmask bit (bit j of hmask[i] for value 32j + i) is 0, so q in -4..3, stored as q + 8. The 6-bit scales: low
    nibbles of bytes 0-7 (subs 0-7), their high nibbles (8-15), top 2 bits from bytes 8-11 (bits 2t: subs 4t + j)."""
    n, s = raw.shape[:2]
    high = np.moveaxis(np.unpackbits(raw[..., 0:32, None], axis=-1, bitorder="little"), -1, -2).reshape(n, s, 256)
    q = (_crumbs(raw[..., 32:96]) + np.uint8(4) + (high << 2)).reshape(n, -1, 16)
    packed = raw[..., 96:108]
    low = np.concatenate([packed[..., 0:8] & 0x0F, packed[..., 0:8] >> 4], axis=-1)
    top = np.concatenate([(packed[..., 8:12] >> (2 * t)) & 0x03 for t in range(4)], axis=-1)
    scales = ((low | (top << 4)).astype(np.float32) - 32) * _half(raw[..., 108:110])[..., None]
    return _Blocks(4, q, _full(q.shape[:2], 8), scales.reshape(n, -1))


# IQ4_NL / IQ4_XS: 4-bit indices into this non-uniform int8 grid (ggml-common.h kvalues_iq4nl); the grid values
# themselves are 8-bit integers, so w = d * grid[q] is exact at 8 bits
IQ4_GRID = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int16)
IQ4_STORED = (IQ4_GRID + 128).astype(np.uint8)


def _iq4_nl(raw):
    """{fp16 d; u8 qs[16]} (Q4_0's nibble order): w = d * grid[q]."""
    q = IQ4_STORED[_nibbles(raw[..., 2:18])]
    return _Blocks(8, q, _full(q.shape[:2], 128), _half(raw[..., 0:2]))


def _iq4_xs(raw):
    """{fp16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]}: 8 subs of 32 (16 bytes each, Q4_0's nibble order),
    w = d*(ls - 32) * grid[q], ls 6 bits: the nibbles of scales_l[j] (low: sub 2j, high: 2j + 1) and bits 2s, 2s+1
    of the little-endian scales_h."""
    n, s = raw.shape[:2]
    q = IQ4_STORED[_nibbles(raw[..., 8:136].reshape(n, s, 8, 16))].reshape(n, -1, 32)
    low = np.stack([raw[..., 4:8] & 0x0F, raw[..., 4:8] >> 4], axis=-1).reshape(n, s, 8)
    high = raw[..., 2:4].astype(np.uint16)
    high = ((high[..., 0:1] | (high[..., 1:2] << 8)) >> (2 * np.arange(8, dtype=np.uint16))) & 0x03
    scales = ((low | (high.astype(np.uint8) << 4)).astype(np.float32) - 32) * _half(raw[..., 0:2])[..., None]
    return _Blocks(8, q, _full(q.shape[:2], 128), scales.reshape(n, -1))


DECODERS = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
}


# --- reshaping, stacking, packing ------------------------------------------------------------------------------------


def _unpermute(blocks: _Blocks, heads: int) -> _Blocks:
    """Rows back from llama.cpp's rotary order (per head: pairs interleaved) to Hugging Face's (halves)."""

    def rows(a):
        return None if a is None else _rows_unpermuted(a, heads)

    return _Blocks(blocks.bits, rows(blocks.q), rows(blocks.zero), rows(blocks.scales), rows(blocks.offsets))


def split(blocks: _Blocks, block: int) -> _Blocks:
    """The same weights in blocks of ``block`` where that is smaller (a divisor): each block's elements are
    contiguous, so a block splits by a reshape; every part keeps its block's scale and zero point."""
    if block >= blocks.block:
        return blocks
    parts = blocks.block // block
    n = blocks.n
    return _Blocks(
        blocks.bits,
        blocks.q.reshape(n, -1, block),
        np.repeat(blocks.zero, parts, axis=1),
        np.repeat(blocks.scales, parts, axis=1),
        blocks.offsets,
    )


def _stack(parts: list[_Blocks]) -> _Blocks:
    """Projections sharing an input, side by side (N summed), in their common exact form: the widest bits, the
    smallest block, offsets zero-filled for the parts that have none."""
    if len(parts) == 1:
        return parts[0]
    if len({p.k for p in parts}) > 1:
        raise ValueError(f"fused projections must share their input width, not {[p.k for p in parts]}")
    block = min(p.block for p in parts)
    parts = [split(p, block) for p in parts]
    offsets = None
    widths = [p.k // p.offsets.shape[1] for p in parts if p.offsets is not None]
    if widths:  # the narrowest offset blocks (16: Q2_K) for all; wider ones repeated, none zero
        width = min(widths)
        offsets = np.concatenate(
            [
                np.zeros((p.n, p.k // width), np.float32)
                if p.offsets is None
                else np.repeat(p.offsets, p.k // p.offsets.shape[1] // width, axis=1)
                for p in parts
            ]
        )
    return _Blocks(
        max(p.bits for p in parts),
        np.concatenate([p.q for p in parts]),
        np.concatenate([p.zero for p in parts]),
        np.concatenate([p.scales for p in parts]),
        offsets,
    )


def _pack(blocks: _Blocks) -> BlockQuant:
    """MatMulNBits' layout (contrib op schema, onnxruntime 1.32): B uint8 [N, K/b, b*bits/8], 4-bit values two a
    byte, low nibble first; zero points uint8 [N, ceil(K/b * bits / 8)] packed the same way, omitted where all are
    the default 2^(bits-1). 8-bit values are stored as q - zero + 128 (uint8 arithmetic wraps; the true value
    q - zero lies in [-128, 127] for every type), so they always use the default."""
    n, k, block = blocks.n, blocks.k, blocks.block
    q, zero = blocks.q, blocks.zero
    if blocks.bits == 8:
        packed = q + (np.uint8(128) - zero)[..., None]
        return BlockQuant(8, block, k, n, np.ascontiguousarray(packed), blocks.scales, None, blocks.offsets)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    zero_points = None
    if (zero != 8).any():
        padded = np.zeros((n, zero.shape[1] + zero.shape[1] % 2), np.uint8)
        padded[:, : zero.shape[1]] = zero
        zero_points = np.ascontiguousarray(padded[:, 0::2] | (padded[:, 1::2] << 4))
    return BlockQuant(4, block, k, n, np.ascontiguousarray(packed), blocks.scales, zero_points, blocks.offsets)


def file_embedding(decoder: Decoder, gguf: GgufFile, permuted_qk: bool = True) -> None:
    """The embedding of a draft that embeds tokens with its target's own table (a feature draft) as the target
    file's blocks, read by GgufGather where the kernel knows their type (else GatherBlockQuantized), checked like
    every layer against the float table the draft was made with; ValueError where the file's token_embd is not that
    table (another shape, a type without an exact form, other values)."""
    _embedding(decoder, FileBytes(gguf.path), gguf.tensors, permuted_qk, native=True, tied_ok=False)
    if decoder.embedding_gguf is None and decoder.embedding_quant is None:
        raise ValueError("the target file's token_embd.weight is not the draft's embedding table (shape or type)")
