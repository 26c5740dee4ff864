"""Stage 4b (``draft_blocks: auto``): the draft the bundle decodes with, chosen by measurement on the machine that
builds it.

Every candidate the pair allows — the GGUF draft file's own blocks (its head whole or cut to the 32k most frequent
target tokens), re-quantized into Q4_0 with its head whole or cut to the 64k / 32k / 16k most frequent target tokens
(builder.gguf.draft_form), the model-free prompt-lookup and suffix drafters, and the hybrid (lookup where the
context has a 2-gram match, the best draft form elsewhere) — is scored by the tokens a second greedy speculative
decoding would make with it at each k, over plain decoding, from two measurements:

- **acceptance per position**, on the target's own greedy continuations of the builder's own prompts (the first code
  completions and chat requests of ``builder/data/distill_prompts.txt``, none of them a bench prompt: acceptance on
  prose docstrings ranked the forms otherwise than on code). With greedy decoding a draft
  token is accepted exactly when the draft, given the target's text so far, picks the target's next token; so one
  teacher-forced pass of a draft over those continuations says, for every position, whether it would be accepted,
  and the steps of speculative decoding at any k follow from it (``simulate``). A model-free drafter is stepped over
  the same text through its own ``propose``; the hybrid takes the lookup's proposal wherever there is one (as the
  runtime's HybridDrafter does before it has costs) and the draft's run elsewhere.
- **call costs** on this machine: target calls of 1..k + 1 tokens by the runtime's own calibration
  (runtime.decoding.step_costs.CostModel), and a draft token's call as a ratio to the target's one-token call from
  one run that times the two in turn (``relative_call``: timed apart, the machine's drift between the runs ranked
  the forms wrongly).

A step drafting k tokens costs k draft calls plus one target call of k + 1 tokens and yields its accepted tokens plus
one; plain decoding costs one one-token call a token. The winner's form is built as the bundle's draft, its drafter
and k become the bundle's defaults, and the table goes into the build report (``draft_choice``). The scores are
estimates for greedy decoding at batch 1; the runtime's planner still picks each step's k from measured costs.
"""

from __future__ import annotations

import functools
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from builder.errors import BuildError
from builder.evaluate import opener
from builder.graph import info_of
from builder.gguf.draft_form import DraftForm
from builder.head_vocab import frequent_ids
from builder.manifest import VOCAB_MAP, eos_ids
from builder.memory import release
from builder.model_surgery import Engine, Model, is_feature_draft
from builder.quantize import native_gguf, quantize_engine
from builder.pairing import Pairing
from runtime.bundle import BuildSpec
from runtime.decoding.sampling import SamplingParams
from runtime.decoding.step_costs import CostModel, fitting_past, relative_call, timed_call
from runtime.drafters.registry import REGISTRY

# (draft_blocks, draft_head): the file as it is, its head cut, and the 4-bit forms
FORMS = (("file", 0), ("file", 32768), ("q4_0", 0), ("q4_0", 65536), ("q4_0", 32768), ("q4_0", 16384))
MODEL_FREE = ("prompt_lookup", "suffix")
HYBRID = "hybrid"
MAX_K = 8
PROMPTS = 3  # of each kind (code completions, chat requests) whose continuations are scored
PROMPT_TOKENS = 256  # each prompt's last tokens at most
NEW_TOKENS = 96  # the target's greedy continuation of each
COST_CALLS = 15  # one-token calls of a draft form and of the target, in turn, that time the form
# a draft whose one-token call costs this share of the target's or more is refused (``refuse_slow_draft``)
SLOW_DRAFT = 1.0
# what a cross-tokenizer pair drafts with by default where the spec's drafter needs one vocabulary (the registry's
# same_vocab)
CROSS_DRAFTER = "tli"


@dataclass(frozen=True)
class Scored:
    """One candidate's measurements and its best k."""

    drafter: str  # "model" (the draft engine) or a model-free drafter's name
    blocks: str = ""  # a model draft's form (draft_blocks, draft_head)
    head: int = 0
    cost: float = 0.0  # a draft token's call over a one-token target call (0: model-free)
    acceptance: tuple[float, ...] = ()  # per position 1..MAX_K: P(accepted | the ones before it were)
    k: int = 0
    speedup: float = 1.0  # expected tokens a second at k over plain decoding's

    @property
    def name(self) -> str:
        form = f"{self.blocks} blocks, head {self.head or 'whole'}"
        return form if self.drafter == "model" else f"{self.drafter} ({form})" if self.blocks else self.drafter

    def row(self) -> dict:
        return {"name": self.name, **{key: value for key, value in asdict(self).items()}}


def prompts(tokenizer) -> list[list[int]]:
    """The builder's own prompts the candidates are scored on: the first PROMPTS code completions (raw text) and chat
    requests (through the tokenizer's chat template) of the shipped distillation corpus, as the runtime encodes
    them."""
    from builder.distill.corpus import encode, load_prompts

    corpus = load_prompts()
    chosen = [p for p in corpus if p.completion][:PROMPTS] + [p for p in corpus if not p.completion][:PROMPTS]
    return [encode(tokenizer, p, None, PROMPT_TOKENS) for p in chosen]


def continuations(target, eos_ids, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """The target's greedy continuation of each prompt, decoded by the runtime's own scheduler (target-only)."""
    from runtime.api import SpeculativeGenerator
    from runtime.core.request import Asked, DecodeRequest

    generator = SpeculativeGenerator(None, target, None, None, eos_ids=eos_ids)
    request = DecodeRequest(max_new_tokens=new_tokens, mode="target")
    results: dict[int, list[int]] = {}
    for index, _, generation in generator.run(generator.door.admit(Asked.tokenized(prompts, request))):
        if generation is not None:
            results[index] = list(generation.token_ids)
    return [results[i] for i in range(len(prompts))]


def agreement(draft, prompt: list[int], continuation: list[int]) -> np.ndarray:
    """Per continuation token, whether the draft (teacher-forced on the prompt and the continuation before it)
    picks it: bool [len(continuation)]."""
    from builder.evaluate import logits_of

    ids = list(prompt) + list(continuation)
    picks = logits_of(draft, ids)[len(prompt) - 1 : len(ids) - 1].argmax(-1)
    return picks == np.asarray(continuation)


Step = tuple[int, bool]  # one step's accepted draft tokens, and whether its drafts cost draft-engine calls


def simulate(agrees: np.ndarray, k: int) -> list[Step]:
    """The steps of greedy speculative decoding with a draft model at ``k`` over a text whose positions the draft
    gets right where ``agrees``: a step accepts the run of right positions from where it starts (at most k), then
    takes the target's own token."""
    return stepped(None, [], [], k, agrees)


def stepped(free, prompt: list[int], continuation: list[int], k: int, agrees: np.ndarray | None = None) -> list[Step]:
    """The steps over the target's text at ``k`` of a model-free drafter ``free`` (its proposals checked against the
    text, as greedy verification would), of a draft model (``agrees``), or of both as the hybrid: the free
    proposal where there is one, the model's elsewhere."""
    length = len(agrees) if agrees is not None else len(continuation)
    if free is not None:
        free.start([list(prompt)])
    params, at, steps = SamplingParams(), 0, []
    while at < length:
        limit = min(k, length - at - 1)
        proposed = free.propose([limit], params, [None]).tokens[0] if free is not None and limit else []
        if proposed:
            run = _matching(proposed, continuation[at:])
        else:
            run = _right_run(agrees, at, limit) if agrees is not None else 0
        if free is not None:
            emitted = continuation[at : at + run + 1]
            free.settle([run], [emitted]) if proposed else free.observe([emitted])
        steps.append((run, not proposed and agrees is not None and limit > 0))
        at += run + 1
    return steps


def _matching(proposed: list[int], text: list[int]) -> int:
    run = 0
    while run < len(proposed) and proposed[run] == text[run]:
        run += 1
    return run


def _right_run(agrees: np.ndarray, at: int, limit: int) -> int:
    run = 0
    while run < limit and agrees[at + run]:
        run += 1
    return run


def per_position(steps: list[Step], k: int) -> tuple[float, ...]:
    """P(position j accepted | positions before it were), j = 1..k, over steps that drafted (at ``k``)."""
    accepted = [a for a, _ in steps]
    out = []
    for j in range(1, k + 1):
        reached = sum(1 for a in accepted if a >= j - 1)
        out.append(round(sum(1 for a in accepted if a >= j) / reached, 4) if reached else 0.0)
    return tuple(out)


def speedup(costs: CostModel, steps: list[Step], k: int) -> float:
    """Expected tokens a second over plain decoding's: the tokens ``steps`` make (accepted + 1 each), each step
    one (k + 1)-token target call plus k draft calls where its drafts were paid for, against one one-token call a
    token."""
    tokens = sum(a + 1 for a, _ in steps)
    seconds = sum((k * costs.draft_cost(1) if paid else 0.0) + costs.call_cost([k + 1]) for _, paid in steps)
    return tokens * costs.call_cost([1]) / seconds


def best_k(costs: CostModel, steps_at: Callable[[int], list[Step]]) -> tuple[int, float]:
    """(k, speedup) of the k in 1..MAX_K with the most expected tokens a second; ``steps_at(k)``: the steps of
    every text at k."""
    score, k = max((speedup(costs, steps_at(k), k), k) for k in range(1, MAX_K + 1))
    return k, round(score, 4)


def score_model(costs: CostModel, blocks: str, head: int, agrees: list[np.ndarray], cost: float) -> Scored:
    """A model draft's row: its acceptance per position and its best k."""
    k, gain = best_k(costs, lambda k: [step for a in agrees for step in simulate(a, k)])
    at_max = [step for a in agrees for step in simulate(a, MAX_K)]
    return Scored("model", blocks, head, round(cost, 4), per_position(at_max, MAX_K), k, gain)


def score_free(costs: CostModel, name: str, make, texts, agrees: list[np.ndarray] | None = None) -> Scored:
    """A model-free drafter's row (``make()``: a fresh one), or with a draft model's ``agrees`` per text, the
    hybrid's."""

    def steps_at(k: int) -> list[Step]:
        pairs = zip(texts, agrees if agrees is not None else [None] * len(texts))
        return [step for (p, c), a in pairs for step in stepped(make(), p, c, k, a)]

    k, gain = best_k(costs, steps_at)
    drafted = [step for step in steps_at(MAX_K)]
    return Scored(name, acceptance=per_position(drafted, MAX_K), k=k, speedup=gain)


def winner(rows: list[Scored]) -> Scored:
    """The candidate with the most expected tokens a second (the first listed among equals)."""
    return max(rows, key=lambda row: row.speedup)


# --- the pair's draft: its vocabulary, its drafter, and (draft_blocks auto) its measured form -----------------------


def draft_vocab(checkpoint, spec: BuildSpec, target_tok, target_ckpt):
    """The kept token ids of a reduced draft head: ``spec.draft_head`` rows of a GGUF draft (builder.head_vocab), or
    those of a draft folder made by ``draftsmith distill --draft-vocab N``; None for a full head."""
    if spec.draft_head:
        if not checkpoint.gguf_file:
            raise BuildError(f"draft_head cuts a GGUF draft's head, but {checkpoint.source} is not a .gguf file")
        vocab = int(checkpoint.config.vocab_size)
        if spec.draft_head >= vocab:
            raise BuildError(f"draft_head {spec.draft_head} is not smaller than the draft's head ({vocab} rows)")
        return frequent_ids(target_tok, spec.draft_head, vocab, eos_ids(target_ckpt, target_tok))
    if checkpoint is target_ckpt or checkpoint.gguf_file or not (checkpoint.folder / VOCAB_MAP).is_file():
        return None
    from builder.distill.save import read_draft_vocab

    return read_draft_vocab(checkpoint.folder)


def cross_pair(spec: BuildSpec, pair: Pairing, draft_ckpt, kept) -> tuple[BuildSpec, Pairing]:
    """(spec, pair) of a draft with a tokenizer of its own, refused where the draft needs the target's vocabulary
    (a reduced head's kept ids and a feature draft's head rows are target ids); a same-vocabulary default drafter
    becomes token-level intersection, the one that drafts with such a draft engine."""
    if kept is not None:
        raise BuildError(
            f"{draft_ckpt.source} has a reduced-vocabulary head ({VOCAB_MAP}: target token ids), but its "
            "tokenizer differs from the target's: a reduced head needs the target's vocabulary"
        )
    if is_feature_draft(draft_ckpt):
        raise BuildError(
            f"{draft_ckpt.source} is a feature draft: it drafts from the target's hidden states with the "
            "target's head rows, so its tokenizer must be the target's"
        )
    if not REGISTRY[spec.drafter].same_vocab:
        return spec, pair
    note = (
        f"the draft has a tokenizer of its own ({pair.shared_tokens} of the target's {pair.vocab_size} tokens "
        f"shared): default drafter {CROSS_DRAFTER!r} (token-level intersection) instead of {spec.drafter!r}, "
        "which needs one vocabulary"
    )
    return (replace(spec, drafter=CROSS_DRAFTER), replace(pair, notes=(*pair.notes, note)))


class Chooser:
    """draft_blocks auto: each candidate draft form built from the GGUF draft file and scored with the model-free
    drafters on the target's own continuations (as the module's docstring says); ``choose`` returns the spec and
    kept ids of the winner, ``report`` the table."""

    def __init__(self, target_tok, target_ckpt, pair, threads: int, say):
        self.target_tok, self.target_ckpt, self.pair = target_tok, target_ckpt, pair
        self.threads, self.say = threads, say
        self.report: dict = {}

    def choose(self, tmp: Path, work: Path, spec: BuildSpec, target: Engine, draft_ckpt, rows: int):
        from runtime.drafters.lookup import PromptLookupDrafter
        from runtime.drafters.registry import DraftSources, make_drafter

        if not draft_ckpt.gguf_file or spec.draft_quant != "gguf":
            raise BuildError("draft_blocks auto chooses among a GGUF draft file's forms: a .gguf draft, quant gguf")
        texts, costs, reference = self._measure_target(tmp / "target" / "model.onnx", target.info)
        model = Model(draft_ckpt, spec, rows)
        info = info_of(model.decoder())
        forms = FORMS if native_gguf(spec) else (("file", 0), ("file", 32768))
        measured = [
            self._score_form(work, spec, draft_ckpt, model, info, blocks, head, texts, (costs, reference))
            for blocks, head in forms
            if head < int(draft_ckpt.config.vocab_size)  # a head no smaller than the vocabulary is the whole one
        ]
        del reference
        scored = [row for row, _, _ in measured]
        sources = DraftSources(target.info.vocab_size, None, False, 0.0)
        for name in MODEL_FREE:
            scored.append(score_free(costs, name, lambda: make_drafter(name, sources), texts))  # noqa: B023
        form, agrees, form_costs = max(measured, key=lambda m: m[0].speedup)
        lookup = functools.partial(PromptLookupDrafter, target.info.vocab_size, 3, 2)  # the hybrid's own
        hybrid = score_free(form_costs, HYBRID, lookup, texts, agrees)
        scored.append(replace(hybrid, blocks=form.blocks, head=form.head, cost=form.cost))
        best = winner(scored)
        engine_form = best if best.blocks else form
        self.report = {
            "candidates": [row.row() for row in scored],
            "winner": best.name,
            "measured_on": f"{len(texts)} greedy target continuations of {NEW_TOKENS} tokens (builder prompts)",
            "target_call_seconds": {str(w): round(t, 5) for (r, w), t in sorted(costs.call.items()) if r == 1},
        }
        chosen = replace(
            spec,
            draft_blocks=engine_form.blocks,
            draft_head=engine_form.head,
            drafter=best.drafter,
            k=best.k,
            max_k=max(spec.max_k, best.k),
        )
        return chosen, self._kept(draft_ckpt, engine_form.head)

    def _measure_target(self, path: Path, info):
        """(prompts with the target's greedy continuations, the target's calibrated call costs, the target engine:
        each draft form's call is timed against it)."""
        engine = opener(
            path, info, max_context=self.pair.max_context, threads=self.threads, vocab_size=info.vocab_size
        )()
        asked = prompts(self.target_tok)
        texts = list(zip(asked, continuations(engine, eos_ids(self.target_ckpt, self.target_tok), asked)))
        costs = CostModel()
        costs.calibrate(engine, None, 1, MAX_K + 1, repeats=5)
        return texts, costs, engine

    def _score_form(
        self, work: Path, spec: BuildSpec, draft_ckpt, model, info, blocks: str, head: int, texts, measured
    ):
        """(its row, its agreement on each text, the costs with its draft call): one draft form built, timed against
        the target (``measured``: the target's costs and engine) and scored, then deleted."""
        costs, reference = measured
        kept = self._kept(draft_ckpt, head)
        path = work / "candidates" / f"{blocks}-{head}" / "model.onnx"
        form_spec = replace(spec, draft_blocks=blocks, draft_head=head)
        quantize_engine(path, path, "gguf", form_spec, draft_ckpt, model, form=DraftForm(blocks, kept))
        shape = replace(info, vocab_size=len(kept) if kept is not None else info.vocab_size)
        engine = opener(
            path, shape, kept, max_context=self.pair.max_context, threads=self.threads, vocab_size=info.vocab_size
        )()
        timed_call(engine, 1, 1, 64, 3)  # warm: a new session's first calls map its weights in
        cost = relative_call(engine, reference, 64, COST_CALLS)
        call = cost * costs.call[(1, 1)]
        agrees = [agreement(engine, p, c) for p, c in texts]
        del engine
        shutil.rmtree(path.parent)
        release()
        form_costs = CostModel(call=dict(costs.call), draft={1: call})
        row = score_model(form_costs, blocks, head, agrees, cost)
        self._say(
            f"choose draft: {row.name}: a draft token {row.cost:.2f} of a target call, best k {row.k}, "
            f"expected {row.speedup:.2f}x plain decoding"
        )
        return row, agrees, form_costs

    def _kept(self, draft_ckpt, head: int):
        if not head:
            return None
        vocab = int(draft_ckpt.config.vocab_size)
        return frequent_ids(self.target_tok, head, vocab, eos_ids(self.target_ckpt, self.target_tok))

    def _say(self, line: str) -> None:
        if self.say is not None:
            self.say(line)


# --- never a draft slower than its target ----------------------------------------------------------------------------


def draft_call_ratio(tmp: Path, pair, target: Engine, draft: Engine, kept, threads: int) -> float:
    """The bundle's draft engine's one-token call over its target's, measured on this machine: both sessions
    opened as the runtime opens them, warmed, then COST_CALLS calls of each timed in turn (``relative_call``, the
    ratio of their medians: timed apart, the machine's drift between two runs moves the ratio)."""
    session = functools.partial(
        opener, max_context=pair.max_context, threads=threads, vocab_size=target.info.vocab_size
    )
    target_engine = session(tmp / "target" / "model.onnx", target.info)()
    draft_engine = session(tmp / "draft" / "model.onnx", draft.info, kept)()
    past = fitting_past(64, 1, target_engine, draft_engine)
    for engine in (target_engine, draft_engine):
        timed_call(engine, 1, 1, past, 3)  # warm: a new session's first calls map its weights in
    ratio = relative_call(draft_engine, target_engine, past, COST_CALLS)
    del target_engine, draft_engine
    release()
    return ratio


def refuse_slow_draft(ratio: float, spec: BuildSpec, limit: float | None = None) -> None:
    """BuildError where a draft token's call costs ``limit`` (SLOW_DRAFT) of the target's one-token call or more
    (``ratio``, measured by ``draft_call_ratio``) and the spec does not allow it (``allow_slow_draft``): speculation
    with such a draft makes fewer tokens a second than the target alone, whatever its acceptance."""
    limit = SLOW_DRAFT if limit is None else limit
    if ratio < limit or spec.allow_slow_draft:
        return
    raise BuildError(
        f"the draft is not faster than its target: its one-token call costs {ratio:.2f} of the target's (medians "
        f"of {COST_CALLS} calls of each, timed in turn on this machine), so speculative decoding with it would be "
        "slower than the target alone. Use a cheaper draft (fewer layers: --draft self:layers=N; a distilled or "
        "feature draft; 4-bit weights: --draft-quant int4, on Draftsmith's kernel where it is built), or build it "
        "anyway with --allow-slow-draft (allow_slow_draft: true in a preset)"
    )
