"""The build pipeline: checkpoint -> pair check -> export -> quantize -> evaluate -> bundle.

Everything is written into a hidden ``.NAME.partial-*`` folder beside the output and renamed into place at the very
end, after manifest.json (the last file written) and an fsync of every file (``builder.publish``: staging, publish and
recovery after a killed run, shared with the distiller's drafts).

Longer than most modules: it is the one place the stages meet (which model each role's graphs come from, whole or
read layer by layer, and what each engine is scored against), so the order in which memory is taken and given back
reads in one file.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import logging
import math
import shutil
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Callable

import numpy as np

from builder import checkpoint as ckpt
from builder import evaluate, export, graph, memory, pairing, quantize
from builder import head_vocab
from builder.gguf import stream as gguf_stream
from builder.gguf.draft_form import DraftForm
from builder.gguf import weights as gguf_weights
from runtime.engines import gguf_ops
from builder import publish as publishing
from builder.decoder import GraphError, from_transformers
from builder.progress import Heartbeat
from runtime.bundle import MANIFEST, BuildSpec, Manifest, ModelEntry, hash_tree, load_manifest
from runtime.engines.onnx import new_engine

log = logging.getLogger(__name__)
Stage = Callable[[str], None]
VOCAB_MAP = "draft_vocab.json"  # a reduced-vocabulary draft head's kept token ids (draft folder and bundle alike)
DRAFT_TOKENIZER = "draft/tokenizer"  # a cross-tokenizer draft's own tokenizer in the bundle (ModelEntry.tokenizer)
# the drafters that need one vocabulary, and what a cross-tokenizer pair drafts with by default (runtime's registry)
SAME_VOCAB_DRAFTERS = ("model", "hybrid", "hybrid_suffix")
CROSS_DRAFTER = "tli"
TOOLS = ("draftsmith", "torch", "transformers", "onnx", "onnxscript", "onnxruntime", "gguf", "tokenizers")


class BuildError(RuntimeError):
    """The build cannot go on; the message says why and what to do."""


def bundle_problem(folder: Path) -> str | None:
    """Why --force may not replace ``folder`` (None: a bundle, i.e. a manifest.json that parses as one, of any schema
    version)."""
    manifest = folder / MANIFEST
    if manifest.is_symlink() or not manifest.is_file():
        return f"it holds no {MANIFEST}"
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return f"its {MANIFEST} does not parse ({err})"
    if not isinstance(data, dict) or not isinstance(data.get("schema_version"), int) or "files" not in data:
        return f"its {MANIFEST} is not a bundle manifest"
    return None


BUNDLE = publishing.Kind("bundle", bundle_problem, BuildError)


def build(
    spec: BuildSpec,
    out: str | Path,
    force: bool = False,
    on_stage: Stage | None = None,
    threads: int = 0,
    say: Callable[[str], None] | None = None,
) -> Manifest:
    """Build a bundle at ``out`` from ``spec``; returns its manifest. ``on_stage(name)`` is called as each starts;
    ``say(line)``, where no progress bar shows, gets a line a minute from the long evaluation stage."""
    out = Path(out).absolute()
    stage = on_stage or (lambda name: None)
    if spec.backend != "onnxruntime":
        raise BuildError(f"backend {spec.backend!r} is built by its own pipeline (builder.trtllm.build)")
    check_output(out, force)
    started = time.perf_counter()
    with staging(out, force) as tmp, _disk_errors(out):
        stage("resolve")
        _check_gguf_kernel(spec)
        target_ckpt, draft_ckpt, draft_layers = _resolve(spec)
        try:
            memory.refuse_if_too_large(_memory_needed(spec, target_ckpt, draft_ckpt), "this build")
            memory.allocate_large_blocks_apart()
            with memory.Watchdog(tmp):
                manifest = _build_into(tmp, spec, target_ckpt, draft_ckpt, draft_layers, stage, threads, say)
        except memory.BuildMemoryError as err:
            raise BuildError(str(err)) from None
        manifest.report["build_seconds"] = round(time.perf_counter() - started, 1)
        return finish(tmp, manifest, out, stage)


def _check_gguf_kernel(spec: BuildSpec) -> None:
    """A build that asks for the native GGUF kernel where its library is not built fails before any work."""
    reason = gguf_ops.unavailable_reason()
    if spec.gguf_kernel == "native" and "gguf" in (spec.target_quant, spec.draft_quant) and reason is not None:
        raise BuildError(f"--gguf-kernel native: {reason}; or build with --gguf-kernel matmulnbits")
    if spec.draft_blocks not in ("file", "auto") and not native_gguf(spec):
        raise BuildError(
            f"draft_blocks {spec.draft_blocks} re-quantizes the draft into blocks of Draftsmith's GGUF kernel, "
            f"which this build does not use ({reason or 'gguf_kernel ' + spec.gguf_kernel}); use draft_blocks file"
        )


def native_gguf(spec: BuildSpec) -> bool:
    """Whether quant gguf engines are written with Draftsmith's GgufMatMul (``spec.gguf_kernel`` resolved here)."""
    return spec.engine_graph == "fused" and gguf_ops.native_for(spec.gguf_kernel)


def _memory_needed(spec: BuildSpec, target_ckpt, draft_ckpt) -> memory.Estimate:
    """The build's estimated peak (builder.memory): a self-draft shares the target's weights."""
    separate = draft_ckpt is not target_ckpt and not _is_feature_draft(draft_ckpt)
    streamed = all(
        gguf_stream.supported(c, spec.engine_graph) for c in ((target_ckpt, draft_ckpt) if separate else (target_ckpt,))
    )
    return memory.estimate(target_ckpt.config, draft_ckpt.config if separate else None, streamed)


def _resolve(spec: BuildSpec):
    target = ckpt.resolve(spec.target, spec.allow_pickle, spec.trust_remote_code)
    draft_layers = 0
    if spec.draft == "self" or spec.draft.startswith("self:"):
        option = spec.draft.partition(":")[2]
        if option.startswith("layers="):
            draft_layers = _positive_int(option[7:], "self:layers=N")
            if draft_layers >= target.config.num_hidden_layers:
                raise BuildError(
                    f"self:layers={draft_layers}: the target has only {target.config.num_hidden_layers} layers"
                )
        elif option and option != spec.draft_quant:
            raise BuildError(
                f"draft {spec.draft!r} conflicts with draft_quant {spec.draft_quant!r}; use "
                f"--draft self --draft-quant {option}, or 'self:layers=N', or a checkpoint path"
            )
        return target, target, draft_layers
    return target, ckpt.resolve(spec.draft, spec.allow_pickle, spec.trust_remote_code), 0


def _positive_int(text: str, what: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise BuildError(f"{what}: N must be a positive integer, received {text!r}")
    return int(text)


@dataclasses.dataclass(frozen=True)
class _Engine:
    """One role's engine as exported: its fp32 graph's info and export check, the fp32 graph the quantizer reads,
    and the graph its quantized form is scored against."""

    info: object  # the graph's GraphInfo
    check: object  # the export check against torch (max |logit difference|, or its report)
    fp32: Path
    reference: Path


def _build_into(
    tmp: Path,
    spec: BuildSpec,
    target_ckpt,
    draft_ckpt,
    draft_layers: int,
    stage: Stage,
    threads: int,
    say: Callable[[str], None] | None = None,
) -> Manifest:
    """The bundle's files in ``tmp`` and its manifest: the pair checked, both engines made and scored, the
    tokenizer saved."""
    stage("pair")
    target_tok = target_ckpt.load_tokenizer()
    draft_tok = target_tok if draft_ckpt is target_ckpt else draft_ckpt.load_tokenizer()
    pair = pairing.pair(target_tok, draft_tok, target_ckpt, draft_ckpt, spec.max_context)
    work = tmp / "_work"
    kept = _draft_vocab(draft_ckpt, spec, target_tok, target_ckpt)  # a reduced-vocabulary draft head
    if pair.cross:
        spec, pair = _cross_pair(spec, pair, draft_ckpt, kept)
    rows = max(pair.max_context, 64)  # positions the graphs' rotary tables cover (the export check uses 64)
    chooser = _Chooser(target_tok, target_ckpt, pair, threads, say) if spec.draft_blocks == "auto" else None
    target, draft, engine_notes, spec, kept = _make_engines(
        tmp, work, spec, target_ckpt, draft_ckpt, draft_layers, kept, rows, stage, chooser
    )
    memory.release()  # the models' weights, dropped with _make_engines' frame
    stage("evaluate")
    report = _evaluate(
        tmp,
        spec,
        target_tok,
        pair,
        target,
        draft,
        kept,
        threads,
        say,
        feature_draft=_is_feature_draft(draft_ckpt),
        draft_tok=draft_tok if pair.cross else None,
    )
    report["engine_notes"] = engine_notes  # e.g. GGUF tensors kept as float weights (no exact MatMulNBits form)
    if chooser is not None:
        report["draft_choice"] = chooser.report
    shutil.rmtree(work)
    stage("tokenizer")
    _save_tokenizer(tmp, target_tok, kept)
    if pair.cross:
        _save_draft_tokenizer(tmp, draft_tok)
    entries = {
        role: _entry(role, c, info, quant, tmp, pair.max_context, spec)
        for role, c, info, quant in (
            ("target", target_ckpt, target.info, spec.target_quant),
            ("draft", draft_ckpt, draft.info, spec.draft_quant),
        )
    }
    if kept is not None:
        entries["draft"] = dataclasses.replace(entries["draft"], vocab_map=f"draft/{VOCAB_MAP}")
    if pair.cross:
        entries["draft"] = dataclasses.replace(entries["draft"], tokenizer=DRAFT_TOKENIZER)
    return Manifest(
        spec=spec,
        target=entries["target"],
        draft=entries["draft"],
        files={},
        default_k=spec.k,
        max_context=pair.max_context,
        eos_token_ids=eos_ids(target_ckpt, target_tok),
        tools=tool_versions(),
        report=report,
    )


def _cross_pair(spec: BuildSpec, pair: pairing.Pairing, draft_ckpt, kept) -> tuple[BuildSpec, pairing.Pairing]:
    """(spec, pair) of a draft with a tokenizer of its own, refused where the draft needs the target's vocabulary
    (a reduced head's kept ids and a feature draft's head rows are target ids); a same-vocabulary default drafter
    becomes token-level intersection, the one that drafts with such a draft engine."""
    if kept is not None:
        raise BuildError(
            f"{draft_ckpt.source} has a reduced-vocabulary head ({VOCAB_MAP}: target token ids), but its "
            "tokenizer differs from the target's: a reduced head needs the target's vocabulary"
        )
    if _is_feature_draft(draft_ckpt):
        raise BuildError(
            f"{draft_ckpt.source} is a feature draft: it drafts from the target's hidden states with the "
            "target's head rows, so its tokenizer must be the target's"
        )
    if spec.drafter not in SAME_VOCAB_DRAFTERS:
        return spec, pair
    note = (
        f"the draft has a tokenizer of its own ({pair.shared_tokens} of the target's {pair.vocab_size} tokens "
        f"shared): default drafter {CROSS_DRAFTER!r} (token-level intersection) instead of {spec.drafter!r}, "
        "which needs one vocabulary"
    )
    return (dataclasses.replace(spec, drafter=CROSS_DRAFTER), dataclasses.replace(pair, notes=(*pair.notes, note)))


def _make_engines(
    tmp: Path,
    work: Path,
    spec: BuildSpec,
    target_ckpt,
    draft_ckpt,
    draft_layers: int,
    kept,
    rows: int,
    stage: Stage,
    chooser: "_Chooser | None" = None,
) -> tuple[_Engine, _Engine, dict[str, list[str]], BuildSpec, object]:
    """(target, draft, each role's engine notes, the spec and kept ids the draft was made with): both engines
    exported to fp32 in ``work`` and quantized into ``tmp``. Where the roles' weights differ only one model is held
    at a time: the target's go before a separate draft's load; a truncated self-draft reads the target's, a whole
    one quantizes the target's own fp32 graph. With a ``chooser`` (draft_blocks auto) the draft's form, drafter and
    k are measured once the target is made (builder.draft_choice)."""
    target, target_model, target_notes = _make_target(
        tmp, work, spec, target_ckpt, draft_ckpt, draft_layers, rows, stage
    )
    if chooser is not None:
        target_model = None
        memory.release()
        stage("choose draft")
        spec, kept = chooser.choose(tmp, work, spec, target, draft_ckpt, rows)
    stage("export draft")
    if draft_ckpt is target_ckpt and not draft_layers:
        draft_model = target_model
        draft = dataclasses.replace(
            target, reference=target.reference if spec.draft_quant == spec.target_quant else target.fp32
        )
    elif _is_feature_draft(draft_ckpt):
        draft_model = None
        info, check = _export_feature_draft(target_model, target_ckpt, draft_ckpt, kept, work / "draft.onnx", spec)
        draft = _Engine(info, check, work / "draft.onnx", work / "draft.onnx")
    else:
        if not draft_layers:
            target_model = None  # a separate draft: the target's weights are written; free them first
            memory.release()
        draft_model = target_model if draft_layers else _Model(draft_ckpt, spec, rows, kept)
        fp32, reference = work / "draft.onnx", _reference_path(work, "draft", draft_model, spec.draft_quant, spec)
        info, check = _export(draft_model, draft_ckpt, fp32, spec, draft_layers, full=reference == fp32)
        if kept is not None and draft_model.streamed is not None:  # the head is cut as its blocks are written
            info = dataclasses.replace(info, vocab_size=len(kept))
        draft = _Engine(info, check, fp32, reference)
    memory.release()
    stage("quantize draft")
    draft_notes = _quantize(
        draft.fp32,
        tmp / "draft" / "model.onnx",
        spec.draft_quant,
        spec,
        target_ckpt if draft_layers else draft_ckpt,
        draft_model,
        draft_layers,
        reference=None if draft.reference == target.reference else draft.reference,
        form=DraftForm(spec.draft_blocks, kept),
    )
    notes = {
        role: list(dict.fromkeys([*engine.info.notes, *notes]))  # the fp32 graph's notes first
        for role, engine, notes in (("target", target, target_notes), ("draft", draft, draft_notes))
    }
    return target, draft, notes, spec, kept


class _Chooser:
    """draft_blocks auto: each candidate draft form built from the GGUF draft file and scored with the model-free
    drafters on the target's own continuations (builder.draft_choice); ``choose`` returns the spec and kept ids of
    the winner, ``report`` the table."""

    def __init__(self, target_tok, target_ckpt, pair, threads: int, say):
        self.target_tok, self.target_ckpt, self.pair = target_tok, target_ckpt, pair
        self.threads, self.say = threads, say
        self.report: dict = {}

    def choose(self, tmp: Path, work: Path, spec: BuildSpec, target: _Engine, draft_ckpt, rows: int):
        from builder import draft_choice as dc
        from runtime.drafters.lookup import PromptLookupDrafter
        from runtime.drafters.registry import DraftSources, make_drafter

        if not draft_ckpt.gguf_file or spec.draft_quant != "gguf":
            raise BuildError("draft_blocks auto chooses among a GGUF draft file's forms: a .gguf draft, quant gguf")
        texts, costs = self._measure_target(tmp / "target" / "model.onnx", target.info)
        model = _Model(draft_ckpt, spec, rows)
        info = graph.info_of(model.decoder())
        forms = dc.FORMS if native_gguf(spec) else (("file", 0), ("file", 32768))
        measured = [
            self._score_form(work, spec, draft_ckpt, model, info, blocks, head, texts, costs)
            for blocks, head in forms
            if head < int(draft_ckpt.config.vocab_size)  # a head no smaller than the vocabulary is the whole one
        ]
        scored = [row for row, _, _ in measured]
        sources = DraftSources(target.info.vocab_size, None, False, 0.0)
        for name in dc.MODEL_FREE:
            scored.append(dc.score_free(costs, name, lambda: make_drafter(name, sources), texts))  # noqa: B023
        form, agrees, form_costs = max(measured, key=lambda m: m[0].speedup)
        lookup = functools.partial(PromptLookupDrafter, target.info.vocab_size, 3, 2)  # the hybrid's own
        hybrid = dc.score_free(form_costs, dc.HYBRID, lookup, texts, agrees)
        scored.append(dataclasses.replace(hybrid, blocks=form.blocks, head=form.head, cost=form.cost))
        best = dc.winner(scored)
        engine_form = best if best.blocks else form
        self.report = {
            "candidates": [row.row() for row in scored],
            "winner": best.name,
            "measured_on": f"{len(texts)} greedy target continuations of {dc.NEW_TOKENS} tokens (builder prompts)",
            "target_call_seconds": {str(w): round(t, 5) for (r, w), t in sorted(costs.call.items()) if r == 1},
        }
        chosen = dataclasses.replace(
            spec,
            draft_blocks=engine_form.blocks,
            draft_head=engine_form.head,
            drafter=best.drafter,
            k=best.k,
            max_k=max(spec.max_k, best.k),
        )
        return chosen, self._kept(draft_ckpt, engine_form.head)

    def _measure_target(self, path: Path, info):
        """(prompts with the target's greedy continuations, the target's calibrated call costs)."""
        from builder import draft_choice as dc
        from runtime.decoding.step_costs import CostModel

        engine = _opener(
            path, info, max_context=self.pair.max_context, threads=self.threads, vocab_size=info.vocab_size
        )()
        prompts = dc.prompts(self.target_tok)
        texts = list(zip(prompts, dc.continuations(engine, eos_ids(self.target_ckpt, self.target_tok), prompts)))
        costs = CostModel()
        costs.calibrate(engine, None, 1, dc.MAX_K + 1, repeats=5)
        return texts, costs

    def _score_form(self, work: Path, spec: BuildSpec, draft_ckpt, model, info, blocks: str, head: int, texts, costs):
        """(its row, its agreement on each text, the costs with its draft call): one draft form built, timed and
        scored, then deleted."""
        from builder import draft_choice as dc
        from runtime.decoding.step_costs import CostModel, timed_call

        kept = self._kept(draft_ckpt, head)
        path = work / "candidates" / f"{blocks}-{head}" / "model.onnx"
        form_spec = dataclasses.replace(spec, draft_blocks=blocks, draft_head=head)
        _quantize(path, path, "gguf", form_spec, draft_ckpt, model, form=DraftForm(blocks, kept))
        shape = dataclasses.replace(info, vocab_size=len(kept) if kept is not None else info.vocab_size)
        engine = _opener(
            path, shape, kept, max_context=self.pair.max_context, threads=self.threads, vocab_size=info.vocab_size
        )()
        timed_call(engine, 1, 1, 64, 3)  # warm: a new session's first calls map its weights in
        call = timed_call(engine, 1, 1, 64, 10)
        agrees = [dc.agreement(engine, p, c) for p, c in texts]
        del engine
        shutil.rmtree(path.parent)
        memory.release()
        form_costs = CostModel(call=dict(costs.call), draft={1: call})
        row = dc.score_model(form_costs, blocks, head, agrees, call / costs.call[(1, 1)])
        self._say(
            f"choose draft: {row.name}: a draft token {row.cost:.2f} of a target call, best k {row.k}, "
            f"expected {row.speedup:.2f}x plain decoding"
        )
        return row, agrees, form_costs

    def _kept(self, draft_ckpt, head: int):
        if not head:
            return None
        vocab = int(draft_ckpt.config.vocab_size)
        return head_vocab.frequent_ids(self.target_tok, head, vocab, eos_ids(self.target_ckpt, self.target_tok))

    def _say(self, line: str) -> None:
        if self.say is not None:
            self.say(line)


def _make_target(
    tmp: Path, work: Path, spec: BuildSpec, target_ckpt, draft_ckpt, draft_layers: int, rows: int, stage: Stage
):
    """(engine, model, the quantizer's notes) of the target, exported and quantized. Its fp32 graph is written whole
    only where something reads it: a whole self-draft quantized from it, or the target scored against it."""
    stage("export target")
    model = _Model(target_ckpt, spec, rows)
    self_fp32 = draft_ckpt is target_ckpt and not draft_layers and spec.draft_quant != "gguf"  # quantized from it
    fp32, reference = work / "target.onnx", _reference_path(work, "target", model, spec.target_quant, spec)
    info, check = _export(model, target_ckpt, fp32, spec, full=self_fp32 or reference == fp32)
    memory.release()  # the torch check's session and arrays
    stage("quantize target")
    notes = _quantize(
        fp32, tmp / "target" / "model.onnx", spec.target_quant, spec, target_ckpt, model, reference=reference
    )
    memory.release()
    return _Engine(info, check, fp32, reference), model, notes


def _evaluate(
    tmp: Path,
    spec: BuildSpec,
    target_tok,
    pair,
    target: _Engine,
    draft: _Engine,
    kept,
    threads: int,
    say: Callable[[str], None] | None,
    feature_draft: bool,
    draft_tok=None,
) -> dict:
    """The report's scores: both engines on the evaluation set's windows against their references (each session
    opened only when the evaluation reaches it), and what they rest on. ``draft_tok``: a draft with a tokenizer of
    its own, scored on windows of its own tokenization of the same text (the same context and token budget)."""
    windows = _windows(target_tok, pair, spec)
    draft_windows = None if draft_tok is None else _windows(draft_tok, pair, spec)
    session = functools.partial(
        _opener, max_context=pair.max_context, threads=threads, vocab_size=target.info.vocab_size
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
    passes = evaluate.passes(engines, references, windows, draft_windows)
    report = evaluate.report(
        engines,
        references,
        windows,
        Heartbeat("evaluate: windows", passes, say),
        feature_roles=("draft",) if feature_draft else (),
        draft_windows=draft_windows,
    )
    if pair.cross:
        report["vocab_bridge"] = _bridge_report(pair, [t for window in windows for t in window])
    if kept is not None:
        ids = [t for window in windows for t in window]
        report["draft_vocab"] = {"kept_ids": len(kept), "eval_coverage": float(np.isin(ids[1:], kept).mean())}
        for key in ("perplexity", "fp32_perplexity"):  # infinite when an eval token is outside the kept ids
            value = report["draft"][key]
            report["draft"][key] = value if math.isfinite(value) else None
    report["export_check_max_abs_logit_diff"] = {"target": target.check, "draft": draft.check}
    report["references"] = {
        role: (
            "the file's blocks in fp32 arithmetic (MatMulNBits accuracy level 0)"
            if ref.name.endswith(".reference.onnx") or ref.parent.name == role
            else "the fp32 graph"
        )
        for role, ref in (("target", target.reference), ("draft", draft.reference))
    }
    report["pair_notes"] = list(pair.notes)
    return report


def _windows(tokenizer, pair, spec: BuildSpec) -> list[list[int]]:
    """The evaluation set as ``tokenizer`` reads it, in the report's windows."""
    return evaluate.eval_windows(tokenizer(evaluate.eval_set_text())["input_ids"], pair.max_context, spec.eval_tokens)


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


def _opener(path: Path, info, kept=None, *, max_context: int, threads: int, vocab_size: int):
    """A function opening the engine at ``path`` when called (the evaluation opens one session at a time); with
    ``kept``, the reduced-head draft compared and scored over the full vocabulary (q = 0 outside the kept ids)."""

    def open_engine():
        engine = new_engine(info.graph, path, info, max_context, threads=threads)
        if kept is not None:
            from runtime.engines.mapped import MappedVocabEngine

            engine = MappedVocabEngine(engine, kept, vocab_size)
        return engine

    return open_engine


def _save_tokenizer(tmp: Path, target_tok, kept) -> None:
    """The target's tokenizer (as tokenizer.json: the runtime reads the fast form only) and a reduced draft head's
    kept ids."""
    target_tok.save_pretrained(str(tmp / "tokenizer"))
    if not (tmp / "tokenizer" / "tokenizer.json").is_file():
        raise BuildError("the target's tokenizer could not be saved as tokenizer.json (a fast tokenizer is needed)")
    if kept is not None:
        (tmp / "draft" / VOCAB_MAP).write_text(json.dumps({"kept_ids": [int(t) for t in kept]}), encoding="utf-8")


def _save_draft_tokenizer(tmp: Path, draft_tok) -> None:
    """A cross-tokenizer draft's own tokenizer, as tokenizer.json (the runtime bridges the two vocabularies by it)."""
    folder = tmp / DRAFT_TOKENIZER
    draft_tok.save_pretrained(str(folder))
    if not (folder / "tokenizer.json").is_file():
        raise BuildError("the draft's tokenizer could not be saved as tokenizer.json (a fast tokenizer is needed)")


def _draft_vocab(checkpoint, spec: BuildSpec, target_tok, target_ckpt):
    """The kept token ids of a reduced draft head: ``spec.draft_head`` rows of a GGUF draft (builder.head_vocab), or
    those of a draft folder made by ``draftsmith distill --draft-vocab N``; None for a full head."""
    if spec.draft_head:
        if not checkpoint.gguf_file:
            raise BuildError(f"draft_head cuts a GGUF draft's head, but {checkpoint.source} is not a .gguf file")
        vocab = int(checkpoint.config.vocab_size)
        if spec.draft_head >= vocab:
            raise BuildError(f"draft_head {spec.draft_head} is not smaller than the draft's head ({vocab} rows)")
        return head_vocab.frequent_ids(target_tok, spec.draft_head, vocab, eos_ids(target_ckpt, target_tok))
    if checkpoint is target_ckpt or checkpoint.gguf_file or not (checkpoint.folder / VOCAB_MAP).is_file():
        return None
    from builder.distill.save import read_draft_vocab

    return read_draft_vocab(checkpoint.folder)


def _is_feature_draft(checkpoint) -> bool:
    from builder.distill.feature_draft import is_feature_draft

    return not checkpoint.gguf_file and is_feature_draft(checkpoint.folder)


def _export_feature_draft(target_model, target_ckpt, draft_ckpt, kept, path: Path, spec: BuildSpec):
    """A feature draft (``draftsmith distill --init feature``) as a fused graph over the target's embeddings and
    head rows, with a ``features`` input, checked against the torch module it was trained as."""
    from builder.distill import feature_draft as fd
    from builder.distill.corpus import DistillError

    if spec.engine_graph != "fused":
        raise BuildError(f"{draft_ckpt.source} is a feature draft: it runs only as the fused graph (--graph fused)")
    try:
        cfg, weights = fd.load_feature_weights(draft_ckpt.folder)
        # refuses a target a feature draft cannot follow, and an MLP wider than the target's
        own = fd.FeatureConfig.of_target(target_ckpt.config, intermediate=cfg.intermediate)
    except DistillError as err:
        raise BuildError(f"{draft_ckpt.source}: {err}") from None
    if cfg.target_sha256 and cfg.target_sha256 != target_ckpt.sha256():
        raise BuildError(
            f"{draft_ckpt.source} was trained on the hidden states of another target "
            f"(sha256 {cfg.target_sha256[:12]}...); distill it again for {target_ckpt.source}"
        )
    # every shape and setting must be the target's (the file is data: its numbers size the graph we write)
    expected = dataclasses.replace(own, target_sha256=cfg.target_sha256)
    if cfg != expected:
        wrong = {k: v for k, v in dataclasses.asdict(cfg).items() if dataclasses.asdict(expected)[k] != v}
        raise BuildError(f"{draft_ckpt.source}: feature_draft.json does not match the target's config: {wrong}")
    embedding, head = target_model.embedding_and_head()
    head = head[kept] if kept is not None else head
    decoder = fd.feature_decoder(cfg, weights, embedding, head)
    graph.build(decoder, path)
    info = graph.info_of(decoder)
    module = fd.module_from(cfg, weights, embedding, head)
    return info, fd.check_against_torch(path, info, module, target_ckpt.architecture.tolerance)


class _Model:
    """What a role's graphs are made from: a GGUF file read layer by layer (builder.gguf.stream: memory follows one
    layer) where the fused graph is written, else the transformers model loaded whole."""

    def __init__(self, checkpoint, spec: BuildSpec, context: int, kept=None):
        self.checkpoint, self.context = checkpoint, context
        self.streamed = (
            gguf_stream.Streamed(checkpoint, context) if gguf_stream.supported(checkpoint, spec.engine_graph) else None
        )
        self.whole = None
        if self.streamed is None:
            self.whole = checkpoint.load_model()
            if kept is not None:  # a reduced-vocabulary draft head
                from builder.distill.draft import reduce_head

                self.whole = reduce_head(self.whole, kept)

    def torch_model(self, layers: int = 0):
        """The transformers model of the first ``layers`` layers (0: all; streamed: at most its reference's)."""
        if self.streamed is not None:
            model = self.streamed.reference
            have = model.config.num_hidden_layers
            return truncate(model, layers) if layers and layers < have else model
        return truncate(self.whole, layers) if layers else self.whole

    def decoder(self, layers: int = 0):
        """The fused graph's Decoder of the first ``layers`` layers (0: all)."""
        if self.streamed is not None:
            return self.streamed.decoder(layers or None)
        return from_transformers(self.torch_model(layers), self.context)

    def embedding_and_head(self) -> tuple[np.ndarray, np.ndarray]:
        """float32 [V, H] each (a feature draft reads the target's)."""
        model = self.torch_model()
        return (
            model.get_input_embeddings().weight.detach().float().numpy(),
            model.get_output_embeddings().weight.detach().float().numpy(),
        )


def _reference_path(work: Path, role: str, model: _Model, quant: str, spec: BuildSpec) -> Path:
    """What the build report scores ``role``'s engine against. A GGUF file's own blocks (quant gguf, read layer by
    layer): the same blocks computed in fp32 (MatMulNBits at accuracy level 0 dequantizes each block to the float32
    weights the fp32 graph holds: max |logit difference| 6e-5 and the same argmax on a 512-token Qwen2.5-Coder-0.5B
    window), whose session holds the file's bytes, not 4 bytes a parameter (6.2 GB for a 1.5B model). Else the fp32
    graph."""
    if quant == "gguf" and model is not None and model.streamed is not None and spec.engine_graph == "fused":
        # accuracy level 0 in MatMulNBits' form: the engine is itself that reference
        itself = spec.accuracy_level == 0 and not native_gguf(spec)
        return work.parent / role / "model.onnx" if itself else work / f"{role}.reference.onnx"
    return work / f"{role}.onnx"


def _export(model: _Model, checkpoint, path: Path, spec: BuildSpec, layers: int = 0, full: bool = True):
    """The fp32 (fp16 on cuda) graph of ``model``'s first ``layers`` layers (0: all) at ``path``, checked against
    torch: (GraphInfo, check report). A streamed GGUF model is checked on its first layers, whose graph is written
    beside ``path`` by the same lazy path (builder.gguf.stream); ``full`` False writes only that (nothing reads the
    whole fp32 graph: the engine is the file's blocks and its reference the same blocks in fp32)."""
    if spec.engine_graph == "fused":
        try:
            decoder = model.decoder(layers)
            if full:
                graph.build(decoder, path)
        except GraphError as err:
            raise BuildError(f"{checkpoint.source}: {err}") from None
        reference = model.torch_model(layers)
        checked = reference.config.num_hidden_layers
        if checked == len(decoder.layers) and full:
            info = graph.info_of(decoder)
            return info, graph.check_against_torch(reference, path, info, checkpoint.architecture.tolerance)
        decoder.notes.append(
            f"read from the GGUF file layer by layer; checked against transformers on its first "
            f"{checked} layers with the embedding and head (the build report scores every layer)"
        )
        info = graph.info_of(decoder)
        check_path = path.with_name(path.stem + ".check.onnx")
        partial = model.decoder(checked)
        graph.build(partial, check_path)
        report = graph.check_against_torch(
            reference, check_path, graph.info_of(partial), checkpoint.architecture.tolerance
        )
        for stale in check_path.parent.glob(check_path.name + "*"):
            stale.unlink()
        return info, report
    whole = model.torch_model(layers)
    info = export.export_decoder(whole, path, spec.opset, export.GRAPH_DTYPES[spec.device])
    check = export.check_against_torch(whole, path, info, checkpoint.architecture.tolerance)
    return info, check


def _quantize(
    src: Path,
    dst: Path,
    quant: str,
    spec: BuildSpec,
    checkpoint,
    model: _Model | None,
    layers: int = 0,
    reference: Path | None = None,
    form: DraftForm | None = None,
) -> list[str]:
    """The engine file: ``src`` quantized by ONNX Runtime's quantizer, or (quant gguf) the fused graph written from
    the GGUF file's own blocks (builder.gguf.weights); ``model``: what ``src`` came from (its first ``layers``
    layers; 0: all), whose weights are those of ``checkpoint``. Returns what the engine's graph notes about itself
    (quant gguf: tensors the file holds in a type without an exact MatMulNBits form). ``reference`` (quant gguf, a
    path other than ``src``): the same blocks are also written there at accuracy level 0 (fp32 arithmetic), what
    the build report scores the engine against. ``form``: a GGUF draft's (builder.gguf.draft_form); its reference
    keeps the file's blocks (the report then says what a re-quantization cost) with the same head rows."""
    if quant != "gguf":
        quantize.quantize(src, dst, quant, spec.block_size, spec.symmetric, spec.accuracy_level)
        return []
    if not checkpoint.gguf_file:
        raise BuildError(
            f"quant gguf keeps a GGUF file's own quantized blocks, but {checkpoint.source} is not a "
            ".gguf file; choose int4 or int8"
        )
    if spec.block_size not in (16, gguf_weights.BLOCK):
        raise BuildError(
            f"quant gguf keeps the file's {gguf_weights.BLOCK}-wide blocks (or halves them: block_size "
            f"16); block_size {spec.block_size} would quantize them again"
        )

    def blocks(native: bool):
        return gguf_weights.apply(
            model.decoder(layers),
            checkpoint.folder / checkpoint.gguf_file,
            spec.block_size,
            permuted_qk=checkpoint.architecture.gguf_permuted_qk,
            native=native,
            form=form,
        )

    native = native_gguf(spec)
    decoder = blocks(native)
    graph.build(decoder, dst, spec.accuracy_level)
    notes = list(decoder.notes) + _kernel_notes(spec, native) + _form_notes(form)
    if reference is not None and reference not in (src, dst):
        del decoder  # its head and embedding blocks: the reference makes its own
        memory.release()
        graph.build(blocks(False), reference, 0)  # MatMulNBits at accuracy level 0: the file's weights in fp32
    return notes


def _form_notes(form: DraftForm | None) -> list[str]:
    """What the report says about a GGUF draft's form."""
    notes = []
    if form is not None and form.requantize_to:
        notes.append(f"re-quantized from the file's values into {form.requantize_to} blocks (a draft's form)")
    if form is not None and form.head_ids is not None:
        notes.append(f"head over {len(form.head_ids)} target tokens (the bundle's vocab_map)")
    return notes


def _kernel_notes(spec: BuildSpec, native: bool) -> list[str]:
    """What the report says about the kernel that multiplies by the file's blocks."""
    if native:
        return [f"the file's blocks as they are, multiplied by Draftsmith's GgufMatMul ({gguf_ops.kernels()} here)"]
    if spec.gguf_kernel == "auto" and spec.engine_graph == "fused":
        return [
            f"ONNX Runtime's MatMulNBits form (~1.5x the file's bytes a token, slower): {gguf_ops.unavailable_reason()}"
        ]
    return []


def truncate(model, layers: int):
    """The target's first ``layers`` decoder layers with its embeddings, final norm and head (shared weights); a
    per-layer config list (Gemma 3's ``layer_types``: sliding or full attention) is cut to match.

    Public: the bench's transformers and ONNX Runtime GenAI peers build the same truncated self draft the bundle
    holds (bench/peers/transformers_peer.py, genai_peer.py)."""
    from builder.distill.draft import clean_config

    draft = _shallow(model)
    draft.config = clean_config(model.config, layers)
    draft.model = _shallow(model.model)
    draft.model.layers = model.model.layers[:layers]
    draft.model.config = draft.config
    return draft


def _shallow(module):
    """A copy of ``module`` sharing its weights but with its own child table (assigning a child to the copy must not
    change the original: copy.copy alone shares the table, which truncated the target too)."""
    import copy

    twin = copy.copy(module)
    twin._modules = dict(module._modules)
    return twin


def _entry(role, checkpoint, info, quant, tmp: Path, max_context: int, spec: BuildSpec) -> ModelEntry:
    engine = f"{role}/model.onnx"
    size = sum(p.stat().st_size for p in (tmp / role).iterdir() if p.is_file())  # not a draft's own tokenizer
    source = spec.target if role == "target" else spec.draft
    return ModelEntry(
        role=role,
        source=source,
        source_sha256=checkpoint.sha256(),
        architecture=checkpoint.architecture.name,
        quant=quant,
        engine=engine,
        num_layers=info.num_layers,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        vocab_size=info.vocab_size,
        max_context=max_context,
        input_names=info.input_names,
        output_names=info.output_names,
        size_bytes=size,
        graph=info.graph,
        min_call_tokens=_min_call_tokens(role, info.graph, tmp / engine),
        source_resolved=str(checkpoint.folder.joinpath(checkpoint.gguf_file or "").resolve()),
    )


def _min_call_tokens(role: str, graph_kind: str, engine: Path) -> int:
    """2 for a fused target with GroupQueryAttention or MatMulNBits: a one-token call takes other kernels than a
    verify call on every CPU measured (MatMulNBits' one-row int8 kernel, GroupQueryAttention's one-query SGEMM;
    runtime.engines.fused.FusedEngine), so its one-token calls are padded to two; 1 for a target made of
    Draftsmith's own operators only (GgufMatMul and CausalAttention score a token alike in any call), and elsewhere
    (a draft need not be exact)."""
    if role != "target" or graph_kind != "fused":
        return 1
    import onnx

    ops = {node.op_type for node in onnx.load(str(engine), load_external_data=False).graph.node}
    return 2 if ops & {"GroupQueryAttention", "MatMulNBits"} else 1


def eos_ids(checkpoint, tokenizer) -> tuple[int, ...]:
    """The target's end-of-sequence ids for the manifest: its config's, its generation_config.json's (not for a GGUF
    source) and its tokenizer's. Public: the TensorRT-LLM build writes the same manifest field
    (builder/trtllm/build.py)."""
    ids = set()
    generation_file = checkpoint.folder / "generation_config.json"
    generation = (
        json.loads(generation_file.read_text(encoding="utf-8")).get("eos_token_id")
        if generation_file.is_file() and not checkpoint.gguf_file
        else None
    )
    eos = getattr(checkpoint.config, "eos_token_id", None)
    for value in (eos, generation, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


def tool_versions() -> dict[str, str]:
    """The installed versions of ``TOOLS`` for the manifest's ``tools``. Public: the TensorRT-LLM build records the
    same (builder/trtllm/build.py)."""
    versions = {}
    for name in TOOLS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def finish(tmp: Path, manifest: Manifest, out: Path, stage: Stage) -> Manifest:
    """Hash, write the manifest last, check the result loads, then publish it at ``out``. Public: the TensorRT-LLM
    build ends its bundles the same way (builder/trtllm/build.py)."""
    stage("manifest")
    complete = dataclasses.replace(manifest, files=hash_tree(tmp))
    (tmp / MANIFEST).write_text(complete.to_json(), encoding="utf-8")
    load_manifest(tmp, verify=True, staging=True)
    publishing.publish(tmp, out)
    return complete


# --- publishing (``builder.publish``, which the distiller's drafts share), with the bundle's kind -------------------


def check_output(out: Path, force: bool) -> None:
    """Refuse an existing ``out`` unless ``force`` and it is a bundle (``builder.publish.check_output``)."""
    publishing.check_output(out, force, BUNDLE)


def staging(out: Path, force: bool):
    """A hidden folder beside ``out`` to write a bundle into (``builder.publish.staging``)."""
    return publishing.staging(out, force, BUNDLE)


@contextmanager
def _disk_errors(out: Path):
    try:
        yield
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise BuildError(
                f"disk full while building {out}; nothing was left behind. Free space "
                "(a bundle needs about 2x the fp32 model size while building) and build again."
            ) from err
        raise
