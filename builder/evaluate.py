"""Stage 5: what quantization cost. Teacher-forced top-1 agreement with the fp32 graph, and perplexity."""

from __future__ import annotations

import functools
import math
from importlib import resources
from pathlib import Path
from typing import Callable

import numpy as np

from builder.memory import release
from builder.progress import Heartbeat
from runtime.bundle import BuildSpec
from runtime.engines.base import Engine
from runtime.engines.onnx import new_engine


EVAL_SET = "data/eval_long.txt"  # the build report's evaluation set (below)
WINDOW = 512  # tokens a window: the set is scored in windows, each from an empty cache (logits [512, V] at most)


def eval_text() -> str:
    """A short text (302 tokens; TensorRT-LLM's calibration paragraphs read it)."""
    return resources.files("builder").joinpath("data/eval.txt").read_text(encoding="utf-8")


def eval_set_text() -> str:
    """The evaluation set: 106 docstrings of 70 Python 3.11 standard-library modules (human-written English
    about code, none in the distillation prompts), the first two of at least 400 characters per module in
    alphabetical order, 110,729 characters: ~25,000 tokens, enough to tell +1% perplexity from +3%. Fixed: shipped
    as a file, not regenerated from whatever Python runs."""
    return resources.files("builder").joinpath(EVAL_SET).read_text(encoding="utf-8")


def eval_windows(ids: list[int], max_context: int, limit: int = 0) -> list[list[int]]:
    """``ids`` (the first ``limit`` of them; 0: all) in consecutive windows of WINDOW tokens (or the context)."""
    ids = ids[:limit] if limit else ids
    width = max(2, min(WINDOW, max_context))
    return [ids[i : i + width] for i in range(0, len(ids), width) if len(ids[i : i + width]) > 1]


def logits_of(engine: Engine, ids: list[int], features: np.ndarray | None = None) -> np.ndarray:
    """Teacher-forced logits [len(ids), V]. A feature draft scores ids[1:] from the target's hidden states
    ``features`` [len(ids), H] (pair j: the state after token j with token j+1), so its row j predicts token j+2."""
    return _forward(engine, ids, features)[0]


def _forward(engine: Engine, ids: list[int], features: np.ndarray | None = None):
    """(teacher-forced logits, the final hidden states [len(ids), H] or None where the graph has none)."""
    cache = engine.new_cache(1)
    if engine.takes_features:
        logits = engine.forward(cache, np.array([ids[1:]], np.int64), features=features[None, :-1])[0]
    else:
        logits = engine.forward(cache, np.array([ids], np.int64))[0]
    hidden = cache.extra.get("hidden")
    return logits, None if hidden is None else hidden[0]


Opener = Callable[[], Engine]


def passes(
    engines: dict[str, Opener],
    references: dict[str, Opener],
    windows: list[list[int]],
    draft_windows: list[list[int]] | None = None,
) -> int:
    """How many windows ``report`` runs, all sessions together (a progress line's total): a reference shared by two
    roles runs once; a draft with its own tokenizer runs over ``draft_windows``."""

    def count(role: str) -> int:
        return len(draft_windows if role == "draft" and draft_windows is not None else windows)

    shared_once = {id(opener): role for role, opener in references.items()}
    return sum(count(role) for role in engines) + sum(count(role) for role in shared_once.values())


def report(
    engines: dict[str, Opener],
    references: dict[str, Opener],
    windows: list[list[int]],
    advance: Callable[[int], None] = lambda n: None,
    feature_roles: tuple[str, ...] = (),
    draft_windows: list[list[int]] | None = None,
) -> dict:
    """Per engine: agreement with its own fp32 graph and perplexity over every window; plus draft/target greedy
    agreement. A feature draft reads the (quantized) target engine's hidden states, as at run time, and is scored
    from each window's second token on (``feature_roles``: the roles whose engines read them). A draft with a
    tokenizer of its own is scored on ``draft_windows``, its own tokenization of the same text; its ids are not the
    target's, so there is no draft/target agreement then.

    ``engines`` and ``references`` open a session when called: one is open at a time (an fp32 1.5B graph's session
    alone holds 6 GB), run over every window, and closed; only each window's argmax and summed NLL are kept. The same
    reference opener under two roles (a self-draft's fp32 graph is the target's) runs once. ``advance(1)`` after
    each window of each session (a build's progress line; ``passes`` counts them)."""
    roles = sorted(engines, key=lambda role: role != "target")  # the target first: its hidden states feed drafts
    role_windows = {role: draft_windows if role == "draft" and draft_windows is not None else windows for role in roles}
    features = None
    scores, done = {}, {}
    for role in roles:
        given = features if role in feature_roles else None
        engine_scores, hidden = _score(
            engines[role],
            role_windows[role],
            given,
            want_hidden=role == "target" and bool(feature_roles),
            advance=advance,
        )
        features = hidden if role == "target" else features
        key = id(references[role])
        if key not in done:
            done[key], _ = _score(references[role], role_windows[role], given, advance=advance)
        scores[role] = (engine_scores, done[key])
    out = {"eval_tokens": sum(len(ids) for ids in windows), "eval_windows": len(windows)}
    for role, (own, fp32) in scores.items():
        rows = sum(len(a) for a in fp32["argmax"])
        agree = sum(int((a == b).sum()) for a, b in zip(own["argmax"], fp32["argmax"]))
        out[role] = {
            "top1_agreement_vs_fp32": agree / max(rows, 1),
            "perplexity": float(np.exp(own["nll"] / max(own["scored"], 1))),
            "fp32_perplexity": float(np.exp(fp32["nll"] / max(fp32["scored"], 1))),
        }
    if draft_windows is not None and "draft" in out:  # its own tokens of the same text
        out["draft"].update(eval_tokens=sum(len(ids) for ids in draft_windows), eval_windows=len(draft_windows))
    elif "draft" in scores and "target" in scores:
        pairs = [(d, t[len(t) - len(d) :]) for d, t in zip(scores["draft"][0]["argmax"], scores["target"][0]["argmax"])]
        rows = sum(len(d) for d, _ in pairs)
        if rows:
            out["draft_target_top1_agreement"] = sum(int((d == t).sum()) for d, t in pairs) / rows
    return out


def _score(
    opener: Opener,
    windows: list[list[int]],
    features: list | None,
    want_hidden: bool = False,
    advance: Callable[[int], None] = lambda n: None,
) -> tuple[dict, list | None]:
    """One session over every window: {"argmax": [per window], "nll": summed, "scored": tokens}, and (target) each
    window's final hidden states."""
    engine = opener()
    takes_features = engine.takes_features
    result = {"argmax": [], "nll": 0.0, "scored": 0}
    hidden = [] if want_hidden else None
    for w, ids in enumerate(windows):
        scored = ids[1:] if takes_features else ids
        logits, state = _forward(engine, ids, None if features is None else features[w])
        result["argmax"].append(logits.argmax(-1))
        result["nll"] += nll_sum(logits, scored)
        result["scored"] += len(scored) - 1
        del logits
        if hidden is not None:
            hidden.append(state)
        advance(1)
    del engine
    release()  # the next session starts from what this one held
    return result, hidden


NLL_ROWS = 64  # rows of logits a log-softmax works on at once (151,936-token vocabularies: 39 MB, not 311)


def nll_sum(logits: np.ndarray, ids: list[int]) -> float:
    """The summed negative log-likelihood of each next token (float64 sums: 25,000 terms), NLL_ROWS rows at a time."""
    total = 0.0
    for start in range(0, len(ids) - 1, NLL_ROWS):
        rows = logits[start : min(start + NLL_ROWS, len(ids) - 1)]
        shifted = rows - rows.max(axis=-1, keepdims=True)
        picked = shifted[np.arange(len(rows)), ids[start + 1 : start + 1 + len(rows)]]
        total -= float((picked - np.log(np.exp(shifted).sum(axis=-1))).astype(np.float64).sum())
    return total


# --- the build report's scores of a bundle's two engines ---------------------------------------------------------


def score_engines(
    tmp: Path,
    spec: BuildSpec,
    target_tok,
    pair,
    target,
    draft,
    kept,
    threads: int,
    say: Callable[[str], None] | None,
    feature_draft: bool,
    draft_tok=None,
) -> dict:
    """The report's scores: both engines on the evaluation set's windows against their references (each session
    opened only when the evaluation reaches it), and what they rest on. ``draft_tok``: a draft with a tokenizer of
    its own, scored on windows of its own tokenization of the same text (the same context and token budget).
    ``target`` and ``draft``: each role's engine as made (builder.model_surgery.Engine)."""
    windows = _windows(target_tok, pair, spec)
    draft_windows = None if draft_tok is None else _windows(draft_tok, pair, spec)
    session = functools.partial(
        opener, max_context=pair.max_context, threads=threads, vocab_size=target.info.vocab_size
    )
    engines = {
        "target": session(tmp / "target" / "model.onnx", target.info),
        "draft": session(tmp / "draft" / "model.onnx", draft.info, kept),
    }
    references = {"target": session(target.reference, target.info)}
    # a self-draft's fp32 graph is the target's: scored once for both
    references["draft"] = (
        references["target"]
        if draft.reference == target.reference and draft.info is target.info
        else session(draft.reference, draft.info, kept)
    )
    total = passes(engines, references, windows, draft_windows)
    scores = report(
        engines,
        references,
        windows,
        Heartbeat("evaluate: windows", total, say),
        feature_roles=("draft",) if feature_draft else (),
        draft_windows=draft_windows,
    )
    _add_grounds(scores, pair, windows, kept, target, draft)
    return scores


def _add_grounds(scores: dict, pair, windows: list[list[int]], kept, target, draft) -> None:
    """What the scores rest on, added to them: the vocabulary bridge of a cross-tokenizer pair, a reduced head's
    coverage of the evaluation tokens (its perplexities None where infinite: a token outside the kept ids), the
    export checks, each role's reference and the pair's notes."""
    if pair.cross:
        scores["vocab_bridge"] = _bridge_report(pair, [t for window in windows for t in window])
    if kept is not None:
        ids = [t for window in windows for t in window]
        scores["draft_vocab"] = {"kept_ids": len(kept), "eval_coverage": float(np.isin(ids[1:], kept).mean())}
        for key in ("perplexity", "fp32_perplexity"):  # infinite when an eval token is outside the kept ids
            value = scores["draft"][key]
            scores["draft"][key] = value if math.isfinite(value) else None
    scores["export_check_max_abs_logit_diff"] = {"target": target.check, "draft": draft.check}
    scores["references"] = {
        role: (
            "the file's blocks in fp32 arithmetic (MatMulNBits accuracy level 0)"
            if ref.name.endswith(".reference.onnx") or ref.parent.name == role
            else "the fp32 graph"
        )
        for role, ref in (("target", target.reference), ("draft", draft.reference))
    }
    scores["pair_notes"] = list(pair.notes)


def _windows(tokenizer, pair, spec: BuildSpec) -> list[list[int]]:
    """The evaluation set as ``tokenizer`` reads it, in the report's windows."""
    return eval_windows(tokenizer(eval_set_text())["input_ids"], pair.max_context, spec.eval_tokens)


def _bridge_report(pair, target_ids: list[int]) -> dict:
    """The report's ``vocab_bridge`` of a cross-tokenizer pair: the intersection's size, both vocabularies', and
    the share of the scored evaluation tokens (the target's) the intersection holds: what a TLI draft can propose
    at all."""
    return {
        "shared_tokens": pair.shared_tokens,
        "target_vocab": pair.vocab_size,
        "draft_vocab": pair.draft_vocab_size,
        "eval_overlap": pair.bridge.overlap(target_ids),
    }


def opener(path: Path, info, kept=None, *, max_context: int, threads: int, vocab_size: int):
    """A function opening the engine at ``path`` when called (the evaluation opens one session at a time); with
    ``kept``, the reduced-head draft compared and scored over the full vocabulary (q = 0 outside the kept ids)."""

    def open_engine():
        engine = new_engine(info.graph, path, info, max_context, threads=threads)
        if kept is not None:
            from runtime.engines.mapped import MappedVocabEngine

            engine = MappedVocabEngine(engine, kept, vocab_size)
        return engine

    return open_engine
