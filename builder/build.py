"""The build pipeline: checkpoint -> pair check -> export -> quantize -> evaluate -> bundle.

This module only orchestrates: it calls each stage once, in order, each from the module that owns it: the roles'
checkpoints (``builder.checkpoint``), the GGUF kernel asked for (``builder.quantize``), the pair
(``builder.pairing``), the draft's vocabulary and drafter (``builder.draft_choice``), both engines made
(``builder.model_surgery``: which model each role's graphs come from, and the order in which memory is taken and
given back; it hands each fp32 graph to ``builder.quantize``), their scores (``builder.evaluate``) and the bundle's
tokenizers and manifest (``builder.manifest``).

Everything is written into a hidden ``.NAME.partial-*`` folder beside the output and renamed into place at the very
end, after manifest.json (the last file written) and an fsync of every file (``builder.publish``: staging, publish and
recovery after a killed run, shared with the distiller's drafts and the TensorRT-LLM build).
"""

from __future__ import annotations

import errno
import logging
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from builder import checkpoint as ckpt
from builder import draft_choice, evaluate, memory, model_surgery, pairing, publish, quantize
from builder.errors import BuildError
from builder.manifest import bundle_manifest, save_tokenizers
from builder.progress import Stage
from runtime.bundle import BuildSpec, Manifest

log = logging.getLogger(__name__)


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
    publish.check_output(out, force, publish.BUNDLE)
    started = time.perf_counter()
    with publish.staging(out, force, publish.BUNDLE) as tmp, _disk_errors(out):
        stage("resolve")
        quantize.check_gguf_kernel(spec)
        target_ckpt, draft_ckpt, draft_layers = ckpt.resolve_roles(spec)
        try:
            needed = model_surgery.memory_needed(spec, target_ckpt, draft_ckpt)
            memory.refuse_if_too_large(needed, "this build")
            memory.allocate_large_blocks_apart()
            with memory.Watchdog(tmp):
                manifest = _build_into(tmp, spec, target_ckpt, draft_ckpt, draft_layers, stage, threads, say)
        except memory.BuildMemoryError as err:
            raise BuildError(str(err)) from None
        manifest.report["build_seconds"] = round(time.perf_counter() - started, 1)
        return publish.finish_bundle(tmp, manifest, out, stage)


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
    spec, pair, target_tok, draft_tok, kept = _pair(spec, target_ckpt, draft_ckpt, stage)
    work = tmp / "_work"
    rows = max(pair.max_context, 64)  # positions the graphs' rotary tables cover (the export check uses 64)
    chooser = draft_choice.Chooser(target_tok, target_ckpt, pair, threads, say) if spec.draft_blocks == "auto" else None
    target, draft, engine_notes, spec, kept = model_surgery.make_engines(
        tmp, work, spec, target_ckpt, draft_ckpt, draft_layers, kept, rows, stage, chooser
    )
    memory.release()  # the models' weights, dropped with make_engines' frame
    stage("time draft")
    ratio = draft_choice.draft_call_ratio(tmp, pair, target, draft, kept, threads)
    draft_choice.refuse_slow_draft(ratio, spec)  # before the long evaluation
    stage("evaluate")
    report = evaluate.score_engines(
        tmp,
        spec,
        target_tok,
        pair,
        target,
        draft,
        kept,
        threads,
        say,
        feature_draft=model_surgery.is_feature_draft(draft_ckpt),
        draft_tok=draft_tok if pair.cross else None,
    )
    report["draft_call_vs_target"] = round(ratio, 3)  # one-token calls, timed in turn (draft_choice)
    report["engine_notes"] = engine_notes  # e.g. GGUF tensors kept as float weights (no exact MatMulNBits form)
    if chooser is not None:
        report["draft_choice"] = chooser.report
    shutil.rmtree(work)
    stage("tokenizer")
    save_tokenizers(tmp, target_tok, draft_tok if pair.cross else None, kept)
    return bundle_manifest(
        tmp, spec, pair, (target_ckpt, draft_ckpt), (target.info, draft.info), kept, target_tok, report
    )


def _pair(spec: BuildSpec, target_ckpt, draft_ckpt, stage: Stage):
    """(spec, pair, target tokenizer, draft tokenizer, kept ids): the two tokenizers checked as a pair, the draft's
    reduced head (its kept target ids, or None) and, where the draft has a tokenizer of its own, its drafter
    (builder.draft_choice)."""
    stage("pair")
    target_tok = target_ckpt.load_tokenizer()
    draft_tok = target_tok if draft_ckpt is target_ckpt else draft_ckpt.load_tokenizer()
    pair = pairing.pair(target_tok, draft_tok, target_ckpt, draft_ckpt, spec.max_context)
    kept = draft_choice.draft_vocab(draft_ckpt, spec, target_tok, target_ckpt)  # a reduced-vocabulary draft head
    if pair.cross:
        spec, pair = draft_choice.cross_pair(spec, pair, draft_ckpt, kept)
    return spec, pair, target_tok, draft_tok, kept


@contextmanager
def _disk_errors(out: Path):
    """A full disk, said as the build's refusal with what to do (the staging folder is removed on the way out)."""
    try:
        yield
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise BuildError(
                f"disk full while building {out}; nothing was left behind. Free space "
                "(a bundle needs about 2x the fp32 model size while building) and build again."
            ) from err
        raise
