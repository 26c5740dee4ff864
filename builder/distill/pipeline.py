"""``distill_draft``: the stages in order, each for the work the recipe plans (builder/distill/plan.py, said with its
expected time before anything slow runs), with progress and the report.

Longer than most modules: the stages are read in the order they run, each a short step; the recipe is
builder/distill/recipe.py, the training loops builder/distill/training.py.

Each stage is a step of its own below, in the order ``distill_draft`` runs them; ``Run`` carries the recipe, the
work plan and the timings from one to the next, ``_Target`` the loaded target. No stage looks at a clock to stop.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from builder.distill import plan
from builder.distill.continuations import Job, eos_ids_of, generate, generate_with_engine, target_engine
from builder.distill.corpus import DistillError, encode, load_prompts, split_prompts
from builder.distill.distributions import teacher
from builder.distill.draft import init_draft, kept_vocabulary
from builder.distill.evaluation import acceptance
from builder.distill.recipe import DistillRecipe
from builder.distill.resumable import distill_resumable
from builder.distill.save import check_out, publish_draft
from builder.distill.self_prompts import self_prompts as sample_self_prompts
from builder.distill.training import chained_agreement, train, train_feature_draft
from runtime.engines import gguf_ops
from builder.distill.run import (
    Run,
    check_target,
    data_fields,
    progress_bars,
    publish_features,
    sampling_fields,
    task,
    training_bar,
    vocab_fields,
)


@dataclass
class _Target:
    """The loaded target; ``model`` is dropped once a draft is made from it, so training has its memory."""

    checkpoint: object
    tokenizer: object
    model: object
    eos: list[int]
    pad: int


def distill_draft(
    recipe: DistillRecipe,
    target: str,
    out: str | Path,
    *,
    threads: int = 0,
    force: bool = False,
    console=None,
    quiet: bool = False,
    work: str | Path | None = None,
) -> dict:
    """Distil a draft for ``target`` by ``recipe`` into the Hugging Face folder ``out``; returns the report (also
    written to ``out/distill_report.json``).

    ``threads``: torch's (0: its default, and the teacher engine's); ``force``: replace the draft folder at ``out``
    (only a draft folder); ``console``: a rich console for progress and lines (default: stderr's, silent with
    ``quiet``). The recipe says how much work each stage does (``DistillRecipe``, builder/distill/plan.py).
    ``work``: where a resumable recipe (``prefill_text``) keeps its data and checkpoints (None: OUT.work beside
    the draft).
    """
    import torch
    from rich.console import Console

    started = time.perf_counter()
    out = Path(out).absolute()
    check_out(
        out,
        force,
        (target,) if recipe.init.startswith("layers=") or recipe.init == "feature" else (target, recipe.init),
    )
    recipe.check()
    console = console or Console(stderr=True, quiet=quiet)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(recipe.seed)
    run = Run(recipe, target, out, force, threads, console, started)
    if recipe.resumable:  # pairs by batched prefill, kept on disk with the training's checkpoints
        return distill_resumable(run, quiet, work)
    corpus, train_prompts, held_prompts = _read_prompts(run)
    loaded = _load_target(run, _plan(run, len(train_prompts), len(held_prompts)))
    train_ids, held_ids = _encoded(run, loaded, train_prompts), _encoded(run, loaded, held_prompts)
    with tempfile.TemporaryDirectory(prefix="draftsmith-teacher-") as work, progress_bars(console, quiet) as progress:
        engine = _teacher_engine(run, loaded, Path(work))
        made, made_ids = _write_own_prompts(run, loaded, engine, corpus, progress)
        samples, held = _continue_prompts(run, loaded, engine, progress, train_ids + made_ids, held_ids)
        engine = None  # its session's memory goes before training
        kept = _choose_vocabulary(run, loaded, samples)
        if recipe.features:
            return _distill_features(run, loaded, samples, held, kept, progress, len(made))
        draft, before, trained = _train_layers(run, loaded, samples, held, kept, progress)
    return _publish_layers(run, loaded.tokenizer, draft, samples, held, kept, before, trained, len(made))


def _read_prompts(run: Run):
    """(corpus, training prompts, held-out prompts), read before the target loads so a bad file fails at once."""
    recipe = run.recipe
    corpus = load_prompts(recipe.prompts)
    train_prompts, held_prompts = split_prompts(corpus, recipe.heldout, recipe.seed)
    run.say(
        f"distill: {len(corpus)} prompts ({len(train_prompts)} train, {len(held_prompts)} held out) from "
        f"{recipe.prompts or 'the shipped corpus'}"
    )
    return corpus, train_prompts, held_prompts


def _plan(run: Run, train_prompts: int, held_prompts: int):
    """The target's checkpoint, checked against ``init`` from its config alone, and the recipe's work and expected
    time said, all before its weights load (minutes for a large one)."""
    from builder import checkpoint as ckpt

    checkpoint = ckpt.resolve(run.target)
    check_target(checkpoint.config, run.recipe.init)
    run.plan(checkpoint.config, train_prompts, held_prompts, _draft_config(run.recipe))
    return checkpoint


def _draft_config(recipe: DistillRecipe):
    """A given draft checkpoint's config (``--init PATH``), for the plan's training estimate; None otherwise or where
    it cannot be read (the estimate then leaves training out; loading it later says what is wrong)."""
    if recipe.init.startswith("layers=") or recipe.features:
        return None
    from builder import checkpoint as ckpt

    try:
        return ckpt.resolve(recipe.init).config
    except Exception:  # noqa: BLE001 - an estimate only: init_draft reports a bad checkpoint
        return None


def _load_target(run: Run, checkpoint) -> _Target:
    """The target's weights; its end-of-sequence ids and the padding id torch's batches use."""
    tokenizer = checkpoint.load_tokenizer()
    model = checkpoint.load_model()
    run.lap("load", run.started)
    eos = eos_ids_of(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    return _Target(checkpoint, tokenizer, model, eos, pad)


def _encoded(run: Run, target: _Target, prompts) -> list[list[int]]:
    """The prompts' token ids as the runtime will see them (chat template or raw text, cut to the last tokens)."""
    return [encode(target.tokenizer, p, run.recipe.chat, run.recipe.max_prompt_tokens) for p in prompts]


def _teacher_engine(run: Run, target: _Target, work: Path):
    """The target as the fused ONNX engine the bundle will run, which continues the prompts and gives the teacher
    rows in the same calls; None where torch does (asked for, or the fused graph cannot express the target, which
    a feature draft cannot do without: it learns from the engine's hidden states)."""
    recipe = run.recipe
    if recipe.teacher_engine == "torch":
        return None
    t0 = time.perf_counter()
    quant = (
        recipe.teacher_engine
        if recipe.teacher_engine != "auto"
        else ("gguf" if target.checkpoint.gguf_file else "fp32")
    )
    engine = target_engine(
        target.model,
        target.checkpoint,
        work,
        quant,
        recipe.accuracy_level,
        recipe.max_prompt_tokens + recipe.max_new_tokens + 8,
        run.threads,
        native=gguf_ops.native_for(recipe.gguf_kernel),
    )
    run.lap("engine", t0)
    run.say(
        f"teacher: the target's fused ONNX engine ({quant})"
        if engine
        else "teacher: the fused graph cannot express this target; torch generates"
    )
    if engine is None and recipe.features:
        raise DistillError(
            "--init feature needs the target as a fused ONNX engine, and the fused graph "
            "cannot express this target; use --init layers=N"
        )
    return engine


def _write_own_prompts(run: Run, target: _Target, engine, corpus, progress):
    """(prompts, their ids): the user queries the target writes itself (``self_prompts`` of them asked for, the
    Magpie method), the distinct finished ones; none unless asked for and the ONNX engine runs (it samples them)."""
    recipe = run.recipe
    if not recipe.self_prompts or engine is None:
        return [], []
    t0 = time.perf_counter()
    made = sample_self_prompts(
        engine,
        target.tokenizer,
        recipe.self_prompts,
        eos_ids=target.eos,
        seed=recipe.seed + 7,
        known=corpus,
        batch_size=recipe.generate_batch,
        advance=task(progress, "target: writing its own prompts", recipe.self_prompts),
    )
    made_ids = _encoded(run, target, made)
    run.lap("self_prompts", t0)
    run.say(
        f"self-prompts: {len(made)} distinct user queries kept of {recipe.self_prompts} asked for"
        + ("" if made else " (no chat template, or none finished: a base model has no user turn)")
    )
    return made, made_ids


def _continue_prompts(run: Run, target: _Target, engine, progress, train_ids, held_ids):
    """(training samples, held-out samples), each with the target's teacher rows: from the ONNX engine's own calls,
    or torch's ``generate`` and then one teacher-forced pass."""
    recipe = run.recipe
    t0 = time.perf_counter()
    if engine is not None:
        samples, held = _engine_continuations(run, target, engine, progress, train_ids, held_ids)
    else:
        samples, held = _torch_continuations(run, target, progress, train_ids, held_ids)
    run.lap("generate", t0)
    if engine is None:
        t0 = time.perf_counter()
        teacher(
            target.model,
            samples,
            recipe.top_k,
            recipe.tokens_per_batch,
            advance=task(progress, "target: teacher distributions", len(samples)),
        )
        run.lap("teacher", t0)
    return samples, held


def _choose_vocabulary(run: Run, target: _Target, samples):
    """The token ids a reduced draft head keeps (``draft_vocab``: the most frequent in the continuations, EOS
    always); None for the full head."""
    size = run.recipe.draft_vocab
    if not size:
        return None
    vocab = min(len(target.tokenizer), target.model.get_output_embeddings().weight.shape[0])
    if size >= vocab:
        raise DistillError(f"--draft-vocab {size} is not smaller than the vocabulary ({vocab})")
    return kept_vocabulary(samples, size, vocab, target.eos)


def _train_layers(run: Run, target: _Target, samples, held, kept, progress):
    """(draft, its acceptance before training, the training's record): a layers=N or given draft, measured on the
    held-out continuations first, then trained for the planned steps."""
    recipe = run.recipe
    draft = init_draft(target.model, recipe.init)
    target.model = None  # the draft holds copies: the target's weights go before training
    before = acceptance(draft, held, kept)
    run.say(
        f"before: held-out top-1 agreement {before.top1:.3f}, greedy acceptance "
        + ", ".join(f"k={k} {before.greedy[k]['acceptance']:.3f}" for k in (2, 4))
    )
    on_step, done = training_bar(
        run,
        progress,
        "draft: training",
        run.work.train_steps,
        lambda step, value, rate, s: f"training: step {step}, loss {value:.4f}, lr {rate:.2e}, {s:.0f} s",
    )
    trained = train(
        draft,
        samples,
        steps=run.work.train_steps,
        lr=recipe.lr,
        loss=recipe.loss,
        kept=kept,
        tokens_per_batch=recipe.tokens_per_batch,
        seed=recipe.seed,
        train_prompt_positions=recipe.train_prompt_positions,
        on_step=on_step,
    )
    done()
    run.timings["train"] = trained["seconds"]
    return draft, before, trained


def _publish_layers(
    run: Run, tokenizer, draft, samples, held, kept, before, trained: dict, self_prompts_kept: int
) -> dict:
    """Measure the trained draft (held out, and on as many training prompts for the overfit), write it with its
    report and say how to build with it."""
    after = acceptance(draft, held, kept)
    train_fit = acceptance(draft, samples[: len(held)], kept, ks=(4,))
    run.say(
        f"after:  held-out top-1 agreement {after.top1:.3f}, greedy acceptance "
        + ", ".join(f"k={k} {after.greedy[k]['acceptance']:.3f}" for k in (2, 4))
        + f" (training prompts: top-1 {train_fit.top1:.3f})"
    )
    run.lap("total", run.started)
    recipe = run.recipe
    report = {
        "target": run.target,
        "init": recipe.init,
        "loss": recipe.loss,
        "seed": recipe.seed,
        "work": run.work.to_dict(),
        "expected_seconds": run.expected,
        "minutes": recipe.minutes,
        "prompts": recipe.prompts_name,
        # train_positions: the positions with teacher rows
        **data_fields(samples, held, sum(len(s.ids) - 1 - s.rows_from for s in samples)),
        "max_new_tokens": recipe.max_new_tokens,
        "generation_temperature": recipe.temperature,
        "top_k": recipe.top_k,
        **sampling_fields(recipe, self_prompts_kept),
        "draft_layers": draft.config.num_hidden_layers,
        **vocab_fields(held, kept),
        "before": before.to_dict(),
        "after": after.to_dict(),
        "train_top1_after": round(train_fit.top1, 4),
        "training": trained,
        "seconds": run.timings,
    }
    publish_draft(draft, tokenizer, run.out, kept, report, run.force)
    run.say(
        f"saved the draft to {run.out} ({run.timings['total']:.0f} s in all); build with: "
        f"build-engines --target {run.target} --draft {run.out}"
    )
    return report


def _distill_features(run: Run, target: _Target, samples, held, kept, progress, self_prompts_kept: int) -> dict:
    """The feature draft (builder/distill/feature_draft.py): trained on the stored hidden states, measured by its
    chained greedy agreement on the held-out continuations, saved beside a one-layer transformers shell."""
    from builder.distill import feature_draft as fd

    recipe = run.recipe
    draft = fd.init_feature_draft(target.model, kept, target.checkpoint.sha256())
    shell_config = target.model.config
    target.model = None  # the feature draft holds copies of the rows it needs
    before = chained_agreement(draft, held, kept)
    run.say(
        f"before: held-out top-1 agreement {before['top1']:.3f}, chained mean accepted {before['mean_accepted']:.2f}"
    )
    on_step, done = training_bar(
        run,
        progress,
        "feature draft: training",
        run.work.train_steps,
        lambda step, value, rate, s: f"feature draft: training step {step}, loss {value:.4f}, lr {rate:.2e}, {s:.0f} s",
    )
    trained = train_feature_draft(
        draft,
        samples,
        steps=run.work.train_steps,
        seed=recipe.seed,
        on_step=on_step,
        tokens_per_batch=plan.FEATURE_TOKENS_PER_BATCH,
    )
    done()
    progress.stop()
    run.timings["train"] = trained["seconds"]
    return publish_features(
        run, target.tokenizer, draft, shell_config, samples, held, kept, before, trained, self_prompts_kept
    )


def _training_jobs(run: Run, train_ids) -> list[Job]:
    """The planned training continuations: pass after pass over the prompts (the first at ``temperature`` with the
    prompt's own teacher rows, the others sampled at ``sample_temperature``), the count the plan says (the last
    pass cut, never a prompt's first sample); the count again if self-written prompts joined the plan's prompts."""
    recipe = run.recipe
    count, _ = plan.continuation_count(recipe, len(train_ids))
    if count != run.work.continuations:
        run.say(f"distill: {count:,} training continuations with the self-written prompts ({len(train_ids)} prompts)")
        run.work = dataclasses.replace(run.work, continuations=count)
    jobs = [Job(p, recipe.temperature) for p in train_ids]
    jobs += [
        Job(p, recipe.sample_temperature, prompt_rows=False)
        for _ in range(1, recipe.samples_per_prompt)
        for p in train_ids
    ]
    return jobs[:count]


def _engine_continuations(run: Run, target: _Target, engine, progress, train_ids, held_ids):
    """(training samples, held-out samples) from the ONNX engine, teacher rows included; the rate of the held-out
    ones (the first the target makes) is said with the time the training ones are expected to take."""
    recipe = run.recipe
    common = {
        "top_k": recipe.top_k,
        "eos_ids": target.eos,
        "batch_size": recipe.generate_batch,
        "features": recipe.features,
    }
    t0 = time.perf_counter()
    held = generate_with_engine(
        engine,
        [Job(p) for p in held_ids],
        recipe.max_new_tokens,
        seed=recipe.seed,
        advance=task(progress, "target: held-out continuations", len(held_ids)),
        **common,
    )
    run.measured_generation(sum(len(s.continuation) for s in held), time.perf_counter() - t0, target.model.config)
    jobs = _training_jobs(run, train_ids)
    samples = generate_with_engine(
        engine,
        jobs,
        recipe.max_new_tokens,
        seed=recipe.seed + 1,
        advance=task(progress, "target: training continuations", len(jobs)),
        **common,
    )
    return samples, held


def _torch_continuations(run: Run, target: _Target, progress, train_ids, held_ids):
    """(training samples, held-out samples) from torch's ``generate``; the teacher rows come after, in one pass.
    The planned jobs go pass by pass (a pass's prompts at one temperature, seeded by the pass)."""
    recipe, model, seed = run.recipe, target.model, run.recipe.seed
    common = {"eos_ids": target.eos, "pad_id": target.pad, "batch_size": recipe.batch_prompts}
    t0 = time.perf_counter()
    held = generate(
        model,
        held_ids,
        recipe.max_new_tokens,
        temperature=0.0,
        seed=seed,
        advance=task(progress, "target: held-out continuations", len(held_ids)),
        **common,
    )
    run.measured_generation(sum(len(s.continuation) for s in held), time.perf_counter() - t0, model.config)
    count = len(_training_jobs(run, train_ids))
    samples = []
    for extra in range(recipe.samples_per_prompt):
        prompts = train_ids[: count - len(samples)]
        if not prompts:
            break
        samples += generate(
            model,
            prompts,
            recipe.max_new_tokens,
            temperature=recipe.temperature if extra == 0 else recipe.sample_temperature,
            seed=seed + extra,
            advance=task(
                progress,
                "target: training continuations" if extra == 0 else f"target: sampled continuations {extra + 1}",
                len(prompts),
            ),
            **common,
        )
    return samples, held
