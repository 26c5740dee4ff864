"""A bundle's ONNX Runtime engines, opened from the bytes its manifest vouches for, with the exactness checks a
target gets on this CPU before it serves (the call shapes that score a token as target-only decoding does)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from runtime.bundle import BundleError, Manifest, read_verified
from runtime.engines.attention_classes import class_points
from runtime.engines.base import Engine
from runtime.engines.call_checks import call_shape_mismatch, prefill_chunks_differ
from runtime.engines.mapped import MappedVocabEngine
from runtime.engines.onnx import new_engine
from runtime.engines.onnx_checks import read_onnx
from runtime.engines.sessions import make_session, providers_for


def open_engines(
    root: Path,
    manifest: Manifest,
    tokenizer_vocab: int,
    roles=("target", "draft"),
    threads: int = 0,
    draft_threads: int | None = None,
    providers: list | None = None,
    device: str | None = None,
    device_id: int = 0,
    verify: bool = True,
) -> dict[str, Engine]:
    """The bundle's ONNX Runtime engines by role, reading logits over the tokenizer's vocabulary, on ``device``
    (default: the bundle's own) unless explicit ``providers`` are given.

    Each engine is made from the bytes that were hashed (``read_onnx``; with ``verify``, checked against the
    manifest), never by reopening a path: a file swapped after verification is not the one that runs.
    """
    device = device or manifest.spec.device
    if providers is None:
        providers = providers_for(device, device_id=device_id)  # fails early, saying what to install
    cache_device = "cuda" if device in ("cuda", "tensorrt") else None
    engines: dict[str, Engine] = {}
    for entry in (manifest.target, manifest.draft):
        if entry.role not in roles:
            continue
        model, external, attention = read_onnx(root, manifest, entry.engine, verify)
        session = make_session(
            model, threads if entry.role == "target" or draft_threads is None else draft_threads, providers, external
        )
        del model, external  # the session holds its own copy: free ours before the next engine is read
        min_call_tokens = _min_call_tokens(entry, attention)
        device_options = (
            {"cache_device": cache_device, "device_id": device_id}
            if entry.graph == "export"
            else {
                "min_call_tokens": min_call_tokens,
                "class_points": _class_points(entry, attention, manifest.max_context, min_call_tokens),
            }
        )
        engine = new_engine(
            entry.graph, root / entry.engine, entry, manifest.max_context, session=session, **device_options
        )
        if entry.vocab_map:  # a reduced-vocabulary draft head: back to full-vocabulary logits, -inf elsewhere
            kept = kept_ids(read_verified(root, manifest, entry.vocab_map, verify), entry.vocab_map)
            engine = MappedVocabEngine(engine, kept, manifest.target.vocab_size)
        if not entry.tokenizer:  # a draft with its own tokenizer reads logits over its own vocabulary
            engine.vocab_size = min(engine.vocab_size, tokenizer_vocab)
        if entry.role == "target" and entry.graph == "fused" and "CPUExecutionProvider" == _first(providers):
            check_call_shapes(engine, root)
        engines[entry.role] = engine
    return engines


def _min_call_tokens(entry, attention: tuple) -> int:
    """A fused target's calls are at least two tokens wide on every CPU where its graph has GroupQueryAttention
    (one-token calls take other kernels: runtime.engines.fused.FusedEngine), also where an older bundle's manifest
    says 1; a graph whose every operator scores a token alike in any call (Draftsmith's CausalAttention over
    GgufMatMul: no GroupQueryAttention settings) takes the manifest's; a draft need not be exact."""
    padded = entry.role == "target" and entry.graph == "fused" and bool(attention)
    return max(entry.min_call_tokens, 2) if padded else entry.min_call_tokens


def _class_points(entry, attention: tuple, max_context: int, min_call_tokens: int) -> tuple[int, ...]:
    """Where the target's calls are cut so that each token is scored as target-only decoding scores it (a draft
    need not be exact; runtime.engines.attention_classes)."""
    if entry.role != "target":
        return ()
    return class_points(attention, entry.head_dim, max_context + min_call_tokens + 1)


def _first(providers: list) -> str:
    first = providers[0] if providers else "CPUExecutionProvider"
    return first[0] if isinstance(first, tuple) else first


_warned: set[str] = set()


def check_call_shapes(engine, root: Path) -> None:
    """The exactness the runtime promises, checked on this CPU before a bundle serves (runtime/engines/
    call_checks.py): where a verify call or a batched step scores a token otherwise than target-only decoding, the
    target runs one token a call (exact, and slower than target-only), and the process says so once, naming the
    bundle and the call shape. What it sets on the engine is set once, here, before any request runs."""
    import logging

    if prefill_chunks_differ(engine, engine.vocab_size):
        engine.prefills_in_chunks = False
        logging.getLogger("draftsmith").warning(
            "bundle %s: on this CPU a prompt prefilled in chunks scores otherwise; servers prefill each prompt whole",
            root,
        )
    differing = call_shape_mismatch(engine, engine.vocab_size)
    if differing is None:
        return
    engine.one_token_calls = True
    if str(root) not in _warned:
        _warned.add(str(root))
        logging.getLogger("draftsmith").warning(
            "bundle %s: on this CPU %s scores a token otherwise than target-only decoding, so speculative output "
            "could differ from the target's own; the target now verifies one token a call (exact, but speculation "
            "will not pay). Please report the CPU (lscpu) and onnxruntime version.",
            root,
            differing,
        )


def kept_ids(data: bytes, where: str) -> np.ndarray:
    """The kept token ids of a vocabulary map ``{"kept_ids": [...]}`` (written by draftsmith distill)."""
    try:
        kept = json.loads(data).get("kept_ids")
    except (ValueError, AttributeError):
        kept = None
    if not isinstance(kept, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in kept):
        raise BundleError(f"{where}: expected an object with a 'kept_ids' list of token ids; rebuild the bundle")
    return np.asarray(kept, dtype=np.int64)
