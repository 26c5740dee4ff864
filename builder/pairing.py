"""Stage 2: can these two checkpoints pair? One vocabulary (the same tokens with the same ids and special tokens), or
two fast tokenizers whose vocabularies share enough tokens (a cross-tokenizer pair, drafted through
runtime/text/vocab_bridge.py); a shared context."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")
# A cross-tokenizer pair needs this much of the target's vocabulary in the intersection: below it neither drafting
# method works (token-level intersection proposes only shared tokens; string-level matching needs text that round
# trips through both). A vocabulary under 2 * MIN_SHARED_TOKENS tokens (test tokenizers) needs half of it.
MIN_SHARED_TOKENS = 1000
MIN_SHARED_SHARE = 0.10


class PairingError(ValueError):
    """Draft and target cannot be used together; the message names the first differences."""


@dataclass(frozen=True)
class Pairing:
    vocab_size: int  # tokens both tokenizers know (cross: the target's); the heads may be padded beyond it
    max_context: int  # the usable context of the pair
    notes: tuple[str, ...] = ()
    cross: bool = False  # the draft has a tokenizer of its own (a cross-tokenizer pair)
    shared_tokens: int = 0  # cross: tokens of both vocabularies (the intersection)
    draft_vocab_size: int = 0  # cross: the draft tokenizer's tokens
    bridge: object = dataclasses.field(default=None, compare=False, repr=False)  # cross: the VocabBridge


def id_differences(target, draft) -> list[str]:
    """Every special token and every token whose id differs between the two tokenizers (specials first, then by
    id)."""
    t_vocab, d_vocab = target.get_vocab(), draft.get_vocab()
    differences = [
        f"{tok!r}: target id {t_vocab.get(tok)}, draft id {d_vocab.get(tok)}"
        for tok in sorted(
            set(t_vocab) | set(d_vocab), key=lambda t: min(t_vocab.get(t, 1 << 60), d_vocab.get(t, 1 << 60))
        )
        if t_vocab.get(tok) != d_vocab.get(tok)
    ]
    for name in SPECIAL:
        t_tok, d_tok = getattr(target, name, None), getattr(draft, name, None)
        if t_tok != d_tok:
            differences.insert(0, f"special {name}: target {t_tok!r}, draft {d_tok!r}")
    return differences


def check_tokenizers(target, draft, show: int = 5) -> Pairing:
    """The vocabulary half of the pair (max_context 0: ``pair`` fills it in). One vocabulary when both tokenizers
    map every token to the same id with the same special tokens; else a cross-tokenizer pair, which needs two fast
    tokenizers sharing enough tokens (PairingError naming the first id differences otherwise)."""
    differences = id_differences(target, draft)
    if not differences:
        return Pairing(len(target.get_vocab()), 0)
    summary = f"the tokenizers differ in {len(differences)} entries (first: {'; '.join(differences[:show])})"
    for role, tok in (("target", target), ("draft", draft)):
        if getattr(tok, "backend_tokenizer", None) is None:
            raise PairingError(
                f"{summary}, and the {role}'s tokenizer is not a fast tokenizer: speculative decoding "
                "across tokenizers needs both as tokenizer.json. Give a checkpoint with tokenizer.json, "
                "or pick a draft from the target's model family."
            )
    bridge = _bridge(target, draft, summary)
    target_vocab = len(target.get_vocab())
    _check_shared(bridge.shared, target_vocab, summary)
    return Pairing(
        target_vocab, 0, cross=True, shared_tokens=bridge.shared, draft_vocab_size=len(draft.get_vocab()), bridge=bridge
    )


def _bridge(target, draft, summary: str):
    """The VocabBridge of two fast tokenizers; PairingError where their tokens' bytes cannot be read."""
    from runtime.text.vocab_bridge import VocabBridge

    try:
        return VocabBridge.between(target.backend_tokenizer, draft.backend_tokenizer)
    except ValueError as err:  # llguidance cannot tell how a tokenizer's tokens decode to bytes
        raise PairingError(
            f"{summary}, and their tokens cannot be compared as bytes ({err}): speculative decoding "
            "across tokenizers needs byte-level or byte-fallback tokenizers"
        ) from None


def min_shared(target_vocab: int) -> int:
    """Tokens a cross-tokenizer pair's intersection must hold (MIN_SHARED_TOKENS, MIN_SHARED_SHARE)."""
    return max(min(MIN_SHARED_TOKENS, target_vocab // 2), math.ceil(target_vocab * MIN_SHARED_SHARE))


def _check_shared(shared: int, target_vocab: int, summary: str) -> None:
    needed = min_shared(target_vocab)
    if shared < needed:
        raise PairingError(
            f"{summary}; the two vocabularies share {shared} tokens ({shared / target_vocab:.1%} of "
            f"the target's {target_vocab}), fewer than the {needed} a draft with another tokenizer "
            "needs: pick a draft whose tokenizer shares more of the target's tokens, or one from the "
            "target's model family."
        )


def check_heads(vocab_size: int, target_config, draft_config, draft_vocab_size: int = 0) -> None:
    """Each output head holds at least its tokenizer's tokens: the target's ``vocab_size``, the draft's
    ``draft_vocab_size`` (0: the same vocabulary)."""
    for role, config, size in (
        ("target", target_config, vocab_size),
        ("draft", draft_config, draft_vocab_size or vocab_size),
    ):
        if config.vocab_size < size:
            raise PairingError(
                f"{role} output head has {config.vocab_size} rows but the tokenizer has {size} "
                "tokens: the checkpoint does not match its tokenizer"
            )


def context_of(config, window_key: str | None) -> int:
    limit = int(getattr(config, "max_position_embeddings", 0) or 0)
    window = getattr(config, window_key, None) if window_key else None
    return min(limit, int(window)) if window else limit


def pair(target_tok, draft_tok, target_ckpt, draft_ckpt, requested_context: int = 0) -> Pairing:
    """All pair checks at once; returns what the bundle needs."""
    vocab = check_tokenizers(target_tok, draft_tok)
    check_heads(vocab.vocab_size, target_ckpt.config, draft_ckpt.config, vocab.draft_vocab_size)
    contexts = {
        role: context_of(c.config, c.architecture.window_key)
        for role, c in (("target", target_ckpt), ("draft", draft_ckpt))
    }
    usable = min(contexts.values())
    notes = []
    if contexts["target"] != contexts["draft"]:
        notes.append(
            f"context lengths differ (target {contexts['target']}, draft {contexts['draft']}): "
            f"usable maximum is {usable}"
        )
    if requested_context:
        if requested_context > usable:
            raise PairingError(f"max_context {requested_context} exceeds the pair's usable maximum {usable}")
        usable = requested_context
    return dataclasses.replace(vocab, max_context=usable, notes=tuple(notes))
