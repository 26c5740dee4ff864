"""The draft model: the target's first N layers with its embeddings, final norm and head (or a given checkpoint), and
its optional reduced-vocabulary head.

Reduced-vocabulary head (``draft_vocab=N``): the draft's head keeps the N token ids the target emitted most often in
the training continuations (plus its EOS ids). They are saved in ``DIR/draft_vocab.json``; ``build-engines`` exports
the draft with only those head rows (``builder.model_surgery.reduce_head``) and the runtime maps its logits back to
the full vocabulary with -inf elsewhere (``runtime.engines.mapped.MappedVocabEngine``), so the draft's q is 0 outside
the kept set and rejection sampling stays exact. The saved safetensors keep the full head, so the folder stays an
ordinary Hugging Face checkpoint.
"""

from __future__ import annotations

import numpy as np

from builder.decoder import clean_config
from builder.distill.corpus import DistillError, Sample


def output_transform(config) -> str | None:
    """What ``config``'s model does to head @ hidden before the softmax, or None. The trainers score a draft as
    hidden @ head (training.py, feature_draft.py) and teach the target's law as softmax(head @ hidden): a capped or
    scaled output would make both wrong."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        return f"final_logit_softcapping {cap}"
    for key in ("logit_scale", "logits_scaling"):
        value = getattr(config, key, None)
        if value not in (None, 1, 1.0):
            return f"{key} {value}"
    return None


def check_init(init: str, total: int) -> int:
    """The layer count of ``layers=N`` (0 for a checkpoint path), checked against the target's ``total`` layers."""
    if init == "feature":  # builder/distill/feature_draft.py: one layer over the target's hidden states
        return 0
    if not init.startswith("layers="):
        if not init:
            raise DistillError("--init: give layers=N or a draft checkpoint")
        return 0
    text = init[7:]
    if not text.isdigit() or not 1 <= int(text) < total:
        raise DistillError(f"--init {init}: N must be an integer in [1, {total - 1}] (the target has {total} layers)")
    return int(text)


def init_draft(target_model, init: str, allow_pickle: bool = False):
    """``layers=N``: a fresh model holding the target's first N layers, embeddings, final norm and head (copies, so
    the target is untouched); otherwise a checkpoint (HF folder or .gguf) to start from."""
    import torch
    from transformers import AutoModelForCausalLM

    if init.startswith("layers="):
        layers = check_init(init, target_model.config.num_hidden_layers)
        config = clean_config(target_model.config, layers)
        torch.manual_seed(0)
        draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        state = target_model.state_dict()
        keep = {}
        for name in draft.state_dict():
            if name in state:
                keep[name] = state[name]
        missing, _unexpected = draft.load_state_dict(keep, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
        if missing:
            raise DistillError(f"--init {init}: the truncated draft has weights the target lacks: {missing[:5]}")
        return draft.eval()
    from builder import checkpoint as ckpt

    draft = ckpt.resolve(init, allow_pickle).load_model()
    draft.config = clean_config(draft.config)
    draft.hf_quantizer = None
    return draft


def kept_vocabulary(samples: list[Sample], size: int, vocab: int, always: list[int]) -> np.ndarray:
    """The ``size`` ids the target emitted most often (ties: lower id first), plus ``always``; sorted."""
    counts = np.zeros(vocab, np.int64)
    for s in samples:
        ids = np.asarray([t for t in s.continuation if t < vocab], np.int64)
        np.add.at(counts, ids, 1)
    boost = np.zeros(vocab, np.int64)
    for s in samples:  # prompt tokens break ties among unseen ones: better than the lowest ids
        ids = np.asarray([t for t in s.prompt if t < vocab], np.int64)
        np.add.at(boost, ids, 1)
    order = np.lexsort((np.arange(vocab), -boost, -counts))  # last key is the primary one
    kept = set(int(t) for t in always if t < vocab)
    for t in order:
        if len(kept) >= size:
            break
        kept.add(int(t))
    return np.array(sorted(kept), np.int64)


def coverage(samples: list[Sample], kept: np.ndarray | None) -> float:
    if kept is None:
        return 1.0
    tokens = np.asarray([t for s in samples for t in s.continuation], np.int64)
    return float(np.isin(tokens, kept).mean()) if len(tokens) else 0.0


def head_weight(draft, kept):
    import torch

    weight = draft.get_output_embeddings().weight
    return weight if kept is None else weight.index_select(0, torch.as_tensor(kept))


def hidden_states(draft, ids, mask):
    base = getattr(draft, draft.base_model_prefix)
    return base(input_ids=ids, attention_mask=mask).last_hidden_state
