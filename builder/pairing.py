"""Stage 2: can these two checkpoints pair? Same tokens with the same ids and special tokens; a shared context."""

from __future__ import annotations

from dataclasses import dataclass

SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


class PairingError(ValueError):
    """Draft and target cannot be used together; the message names the first differences."""


@dataclass(frozen=True)
class Pairing:
    vocab_size: int  # tokens both tokenizers know (the heads may be padded beyond it)
    max_context: int  # the usable context of the pair
    notes: tuple[str, ...] = ()


def check_tokenizers(target, draft, show: int = 5) -> int:
    """Raise PairingError unless both tokenizers map every token to the same id; return the vocabulary size."""
    t_vocab, d_vocab = target.get_vocab(), draft.get_vocab()
    differences = [f"{tok!r}: target id {t_vocab.get(tok)}, draft id {d_vocab.get(tok)}"
                   for tok in sorted(set(t_vocab) | set(d_vocab), key=lambda t: min(t_vocab.get(t, 1 << 60),
                                                                                      d_vocab.get(t, 1 << 60)))
                   if t_vocab.get(tok) != d_vocab.get(tok)]
    for name in SPECIAL:
        t_tok, d_tok = getattr(target, name, None), getattr(draft, name, None)
        if t_tok != d_tok:
            differences.insert(0, f"special {name}: target {t_tok!r}, draft {d_tok!r}")
    if differences:
        raise PairingError(
            f"draft and target tokenizers differ in {len(differences)} entries; first: " + "; ".join(differences[:show])
            + ". Speculative decoding needs one shared vocabulary: pick a draft from the target's model family.")
    return len(t_vocab)


def check_heads(vocab_size: int, target_config, draft_config) -> None:
    for role, config in (("target", target_config), ("draft", draft_config)):
        if config.vocab_size < vocab_size:
            raise PairingError(f"{role} output head has {config.vocab_size} rows but the tokenizer has {vocab_size} "
                               "tokens: the checkpoint does not match its tokenizer")


def context_of(config, window_key: str | None) -> int:
    limit = int(getattr(config, "max_position_embeddings", 0) or 0)
    window = getattr(config, window_key, None) if window_key else None
    return min(limit, int(window)) if window else limit


def pair(target_tok, draft_tok, target_ckpt, draft_ckpt, requested_context: int = 0) -> Pairing:
    """All pair checks at once; returns what the bundle needs."""
    vocab_size = check_tokenizers(target_tok, draft_tok)
    check_heads(vocab_size, target_ckpt.config, draft_ckpt.config)
    contexts = {role: context_of(c.config, c.architecture.window_key)
                for role, c in (("target", target_ckpt), ("draft", draft_ckpt))}
    usable = min(contexts.values())
    notes = []
    if contexts["target"] != contexts["draft"]:
        notes.append(f"context lengths differ (target {contexts['target']}, draft {contexts['draft']}): "
                     f"usable maximum is {usable}")
    if requested_context:
        if requested_context > usable:
            raise PairingError(f"max_context {requested_context} exceeds the pair's usable maximum {usable}")
        usable = requested_context
    return Pairing(vocab_size, usable, tuple(notes))
