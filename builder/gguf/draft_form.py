"""The form a GGUF draft's engine takes: its file's own blocks, or re-quantized into the kernel's 4-bit blocks, with
its head over all the target's tokens or over the N most frequent ones.

A draft's precision changes how often its tokens are accepted, never the output (the target verifies every token):
so a draft can be stored coarser than its file where that makes it cheaper. Qwen2.5-Coder-0.5B's Q4_K_M file is ~8
bits a weight where a token reads it (Q5_0 / Q8_0 / Q6_K: its 896-wide rows do not fit K-quant super-blocks, so the
converter fell back to 32-wide types); re-quantized to Q4_0 (4.5 bits, a type GgufMatMul streams) it reads ~0.7 of
that, and with a 32k-row head (FR-Spec, Zhao et al. 2025: the draft's head over the most frequent tokens) ~0.55.
Re-quantizing is a second quantization of the file's values (gguf's own Q4_0 quantizer over the dequantized
weights), which is why it is offered for drafts only and its cost is measured (the build report scores the engine
against the file's blocks; the bench measures acceptance).

Rows of a head are independent, so a reduced head is the file's rows for the kept ids, in block form, never a
float copy; the bundle's ``vocab_map`` maps them back (runtime.engines.mapped: q is exactly 0 elsewhere, so sampled
decoding stays exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# draft_blocks -> the GGUF type the weights are re-quantized into (None: the file's own blocks)
BLOCK_FORMS = {"file": None, "q4_0": "Q4_0"}


@dataclass(frozen=True)
class DraftForm:
    """How a draft engine is written from its GGUF file: ``blocks`` (a key of BLOCK_FORMS) and ``head_ids`` (the
    target token ids its head keeps, in the head's row order; None: every row)."""

    blocks: str = "file"
    head_ids: np.ndarray | None = None

    @property
    def requantize_to(self) -> str | None:
        return BLOCK_FORMS[self.blocks]


def requantized(values: np.ndarray, kind: str) -> np.ndarray:
    """float32 weights [N, K] (rows of outputs, K a multiple of 32) as GGUF blocks of ``kind``, uint8 [N, bytes a
    row], quantized by the ``gguf`` package (ggml's reference quantizer: for Q4_0 d = the block's value of largest
    magnitude / -8, q = round(x / d) + 8 clamped to 0..15)."""
    from gguf import GGMLQuantizationType, quants

    return np.ascontiguousarray(quants.quantize(np.ascontiguousarray(values, np.float32), GGMLQuantizationType[kind]))


def check_requantized(name: str, raw: np.ndarray, kind: str, values: np.ndarray) -> None:
    """Refuse blocks whose dequantization (the ``gguf`` package's) is not within one quantization step of
    ``values``: |error| <= d = max|x| / 8 of each 32-block (half a step inside the range; a full one where the
    value opposite the block's largest is clamped to q = 15), plus the fp16 rounding of d (relative, and absolute
    where d is an fp16 subnormal: 2^-24 a step, eight of them at q = -8)."""
    from gguf import GGMLQuantizationType, quants

    back = quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(values.shape)
    blocks = values.reshape(len(values), -1, 32)
    step = np.abs(blocks).max(axis=-1, keepdims=True) / 8
    error = np.abs(back.reshape(blocks.shape) - blocks)
    bound = step * (1 + 8 * 2.0**-11) + 8 * 2.0**-24  # d in fp16: 2^-11 relative, 2^-24 absolute
    if not np.all(error <= bound):
        worst = float((error - bound).max())
        raise ValueError(f"{name}: re-quantized to {kind}, a value moved {worst:.3g} more than one quantization step")


KERNEL_BLOCKS = "q4_0"  # the form a draft of float weights takes on the kernel (a key of BLOCK_FORMS)
