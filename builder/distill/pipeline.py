"""``distill_draft``: the stages in order, under one wall-clock budget, with progress and the report."""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

from builder.distill.continuations import Job, eos_ids_of, generate, generate_with_engine, target_engine
from builder.distill.corpus import DistillError, encode, load_prompts, split_prompts
from builder.distill.distributions import teacher
from builder.distill.draft import check_init, coverage, init_draft, kept_vocabulary, output_transform
from builder.distill.evaluation import acceptance
from builder.distill.save import check_out, publish_draft
from builder.distill.self_prompts import self_prompts as sample_self_prompts
from builder.distill.training import train
from builder.progress import Heartbeat


def check_target(config, init: str) -> int:
    """Everything ``init`` needs of the target's ``config``, checked before anything slow runs; returns what
    ``check_init`` does (the layer count of ``layers=N``, else 0)."""
    layers = check_init(init, config.num_hidden_layers)
    if init == "feature":
        from builder.distill.feature_draft import FeatureConfig  # torch-free until a feature draft is asked for
        FeatureConfig.of_target(config)  # refuses what a feature draft cannot follow
    elif output_transform(config):
        raise DistillError(f"--init {init}: the target's logits are not its head times its final hidden state "
                           f"({output_transform(config)}), which the trainer assumes; use an int4 self-draft "
                           "(build-engines --draft self)")
    return layers


def distill_draft(target: str, init: str, out: str | Path, *, prompts: str | Path | None = None,
                  minutes: float = 15.0, max_new_tokens: int = 64, seed: int = 0, threads: int = 0,
                  draft_vocab: int = 0, loss: str = "kl", temperature: float = 0.0, heldout: float = 0.1,
                  top_k: int = 32, lr: float = 5e-4, batch_prompts: int = 16, tokens_per_batch: int = 1024,
                  max_steps: int | None = None, max_prompt_tokens: int = 256, chat: bool | None = None,
                  generate_share: float = 0.4, samples_per_prompt: int = 1, sample_temperature: float = 1.0,
                  train_prompt_positions: bool = True, teacher_engine: str = "auto", accuracy_level: int = 4,
                  generate_batch: int = 32, self_prompts: int = 0, force: bool = False, console=None,
                  quiet: bool = False) -> dict:
    """Distil a draft for ``target`` into the Hugging Face folder ``out``; returns the report (also written to
    ``out/distill_report.json``).

    ``minutes`` is the whole budget: after loading the target, generation may use ``generate_share`` of what is left
    (at least one batch), training the rest less a reserve for the final measurement. ``max_steps`` (tests) bounds
    training by steps instead of time.

    ``samples_per_prompt`` > 1 adds continuations sampled at ``sample_temperature`` after the first pass (while the
    generation share lasts): a small corpus then yields more distinct target text, so the draft overfits less (one
    greedy continuation per prompt of the 208 shipped ones gave 0.98 top-1 on training prompts, 0.28 held out).

    ``teacher_engine``: what generates the continuations and the teacher rows. ``auto`` is the fused ONNX engine the
    bundle's target will be (a GGUF file's own blocks, or fp32), in continuous batches of ``generate_batch`` rows,
    ~4x torch's ``generate`` here and with the teacher rows from the same calls; ``torch`` is transformers.

    ``self_prompts`` > 0: before the continuations, the target samples that many user queries from its chat
    template's user-turn prefix (builder/distill/self_prompts.py, the Magpie method); the distinct, finished ones join
    the training prompts (the held-out prompts stay the shipped ones).
    """
    import torch
    from rich.console import Console

    from builder import checkpoint as ckpt
    started = time.perf_counter()
    deadline = started + minutes * 60
    out = Path(out).absolute()
    check_out(out, force)
    if draft_vocab < 0:
        raise DistillError(f"--draft-vocab must be >= 0, received {draft_vocab}")
    if samples_per_prompt < 1 or sample_temperature <= 0:
        raise DistillError(f"--samples-per-prompt must be >= 1 and --sample-temperature > 0, received "
                           f"{samples_per_prompt} and {sample_temperature}")
    if teacher_engine not in ("auto", "gguf", "fp32", "torch"):
        raise DistillError(f"--teacher-engine must be auto, gguf, fp32 or torch, received {teacher_engine!r}")
    features = init == "feature"
    if features and teacher_engine == "torch":
        raise DistillError("--init feature trains on the target engine's hidden states: use --teacher-engine auto, "
                           "gguf or fp32")
    if self_prompts < 0:
        raise DistillError(f"--self-prompts must be >= 0, received {self_prompts}")
    if self_prompts and teacher_engine == "torch":
        raise DistillError("--self-prompts samples with the target's ONNX engine: use --teacher-engine auto")
    if generate_batch < 1:
        raise DistillError(f"--generate-batch must be >= 1, received {generate_batch}")
    if not 0 < generate_share < 1:
        raise DistillError(f"--generate-share must be in (0, 1), received {generate_share}")
    console = console or Console(stderr=True, quiet=quiet)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    say = console.print
    corpus = load_prompts(prompts)
    train_prompts, held_prompts = split_prompts(corpus, heldout, seed)
    say(f"distill: {len(corpus)} prompts ({len(train_prompts)} train, {len(held_prompts)} held out) from "
        f"{prompts or 'the shipped corpus'}")
    checkpoint = ckpt.resolve(target)
    check_target(checkpoint.config, init)
    tokenizer = checkpoint.load_tokenizer()
    target_model = checkpoint.load_model()
    timings = {"load": round(time.perf_counter() - started, 1)}
    eos = eos_ids_of(target_model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    train_ids = [encode(tokenizer, p, chat, max_prompt_tokens) for p in train_prompts]
    held_ids = [encode(tokenizer, p, chat, max_prompt_tokens) for p in held_prompts]

    with tempfile.TemporaryDirectory(prefix="draftsmith-teacher-") as work, _progress(console, quiet) as progress:
        t0 = time.perf_counter()
        engine = None
        if teacher_engine != "torch":
            quant = teacher_engine if teacher_engine != "auto" else ("gguf" if checkpoint.gguf_file else "fp32")
            engine = target_engine(target_model, checkpoint, Path(work), quant, accuracy_level,
                                   max_prompt_tokens + max_new_tokens + 8, threads)
            timings["engine"] = round(time.perf_counter() - t0, 1)
            say(f"teacher: the target's fused ONNX engine ({quant})" if engine else
                "teacher: the fused graph cannot express this target; torch generates")
            if engine is None and features:
                raise DistillError("--init feature needs the target as a fused ONNX engine, and the fused graph "
                                   "cannot express this target; use --init layers=N")
        made = []
        if self_prompts and engine is not None:
            t0 = time.perf_counter()
            share = 0.25 * generate_share * max(0.0, deadline - t0)  # a quarter of the generation share at most
            made = sample_self_prompts(engine, tokenizer, self_prompts, eos_ids=eos, seed=seed + 7, known=corpus,
                                       batch_size=generate_batch, deadline=t0 + share,
                                       advance=_task(progress, "target: writing its own prompts", self_prompts,
                                                     t0 + share))
            train_ids += [encode(tokenizer, p, chat, max_prompt_tokens) for p in made]
            timings["self_prompts"] = round(time.perf_counter() - t0, 1)
            say(f"self-prompts: {len(made)} distinct user queries kept of {self_prompts} asked for"
                + ("" if made else " (no chat template, or none finished: a base model has no user turn)"))
        t0 = time.perf_counter()
        if engine is not None:
            samples, held = _engine_continuations(engine, progress, train_ids, held_ids, deadline, generate_share,
                                                  max_new_tokens, temperature, samples_per_prompt,
                                                  sample_temperature, top_k, eos, seed, generate_batch, features)
        else:
            samples, held = _torch_continuations(target_model, progress, train_ids, held_ids, deadline,
                                                 generate_share, max_new_tokens, temperature, samples_per_prompt,
                                                 sample_temperature, eos, pad, seed, batch_prompts)
        timings["generate"] = round(time.perf_counter() - t0, 1)
        if engine is None:
            t0 = time.perf_counter()
            teacher(target_model, samples, top_k, tokens_per_batch,
                    advance=_task(progress, "target: teacher distributions", len(samples)))
            timings["teacher"] = round(time.perf_counter() - t0, 1)
        engine = None  # its session's memory goes before training
        if not samples:
            raise DistillError("the budget ran out before any training continuation was generated; raise --minutes")

        kept = None
        if draft_vocab:
            vocab = min(len(tokenizer), target_model.get_output_embeddings().weight.shape[0])
            if draft_vocab >= vocab:
                raise DistillError(f"--draft-vocab {draft_vocab} is not smaller than the vocabulary ({vocab})")
            kept = kept_vocabulary(samples, draft_vocab, vocab, eos)
        if features:
            return _distill_features(target_model, checkpoint, tokenizer, samples, held, kept, out, force, deadline,
                                     max_steps, progress, console, say, started, timings, {
                                         "target": target, "init": init, "seed": seed, "minutes": minutes,
                                         "prompts": str(prompts) if prompts else "builtin:distill_prompts.txt",
                                         "max_new_tokens": max_new_tokens, "samples_per_prompt": samples_per_prompt,
                                         "sample_temperature": sample_temperature,
                                         "generate_share": generate_share, "teacher_engine": teacher_engine,
                                         "self_prompts": self_prompts, "self_prompts_kept": len(made)},
                                     seed, quiet)
        draft = init_draft(target_model, init)
        del target_model
        t0 = time.perf_counter()
        before = acceptance(draft, held, kept)
        measure = time.perf_counter() - t0
        say(f"before: held-out top-1 agreement {before.top1:.3f}, greedy acceptance "
            + ", ".join(f"k={k} {before.greedy[k]['acceptance']:.3f}" for k in (2, 4)))
        train_deadline = deadline - 1.5 * measure - 5
        if max_steps is None and train_deadline <= time.perf_counter():
            raise DistillError(f"no time left to train within --minutes {minutes}; raise it")
        total = max_steps or max(1, int(train_deadline - time.perf_counter()))
        task = progress.add_task("draft: training", total=total)
        t0 = time.perf_counter()

        last_line = [time.perf_counter()]

        def on_step(step, value, rate):
            done = step if max_steps else min(total, time.perf_counter() - t0)
            progress.update(task, completed=done, description=f"draft: training (loss {value:.3f})")
            if not console.is_terminal and time.perf_counter() - last_line[0] > 60:  # logs: a line a minute
                last_line[0] = time.perf_counter()
                say(f"training: step {step}, loss {value:.4f}, lr {rate:.2e}, {time.perf_counter() - t0:.0f} s")

        trained = train(draft, samples, deadline=train_deadline, max_steps=max_steps, lr=lr, loss=loss, kept=kept,
                        tokens_per_batch=tokens_per_batch, seed=seed, train_prompt_positions=train_prompt_positions,
                        on_step=on_step)
        progress.update(task, completed=total)
    timings["train"] = trained["seconds"]
    after = acceptance(draft, held, kept)
    train_fit = acceptance(draft, samples[: len(held)], kept, ks=(4,))
    say(f"after:  held-out top-1 agreement {after.top1:.3f}, greedy acceptance "
        + ", ".join(f"k={k} {after.greedy[k]['acceptance']:.3f}" for k in (2, 4))
        + f" (training prompts: top-1 {train_fit.top1:.3f})")
    timings["total"] = round(time.perf_counter() - started, 1)
    report = {
        "target": target, "init": init, "loss": loss, "seed": seed, "minutes": minutes,
        "prompts": str(prompts) if prompts else "builtin:distill_prompts.txt",
        "train_prompts": len(samples), "heldout_prompts": len(held),
        "train_tokens": sum(len(s.continuation) for s in samples),
        "train_positions": sum(len(s.ids) - 1 - s.rows_from for s in samples),  # positions with teacher rows
        "heldout_tokens": sum(len(s.continuation) for s in held),
        "max_new_tokens": max_new_tokens, "generation_temperature": temperature, "top_k": top_k,
        "samples_per_prompt": samples_per_prompt, "sample_temperature": sample_temperature,
        "generate_share": generate_share, "teacher_engine": teacher_engine,
        "self_prompts": self_prompts, "self_prompts_kept": len(made),
        "draft_layers": draft.config.num_hidden_layers,
        "draft_vocab": int(len(kept)) if kept is not None else 0,
        "draft_vocab_coverage_heldout": round(coverage(held, kept), 4),
        "before": before.to_dict(), "after": after.to_dict(), "train_top1_after": round(train_fit.top1, 4),
        "training": trained, "seconds": timings,
    }
    publish_draft(draft, tokenizer, out, kept, report, force)
    say(f"saved the draft to {out} ({timings['total']:.0f} s in all); build with: "
        f"build-engines --target {target} --draft {out}")
    return report


def _distill_features(target_model, checkpoint, tokenizer, samples, held, kept, out, force, deadline, max_steps,
                      progress, console, say, started, timings, report, seed, quiet) -> dict:
    """The feature draft (builder/distill/feature_draft.py): trained on the stored hidden states, measured by its
    chained greedy agreement on the held-out continuations, saved beside a one-layer transformers shell."""
    from builder.distill import feature_draft as fd
    draft = fd.init_feature_draft(target_model, kept, checkpoint.sha256())
    shell_config = target_model.config
    del target_model
    t0 = time.perf_counter()
    before = fd.chained_agreement(draft, held, kept)
    measure = time.perf_counter() - t0
    say(f"before: held-out top-1 agreement {before['top1']:.3f}, chained mean accepted {before['mean_accepted']:.2f}")
    train_deadline = deadline - 2 * measure - 10
    if max_steps is None and train_deadline <= time.perf_counter():
        raise DistillError("no time left to train within --minutes; raise it")
    total = max_steps or max(1, int(train_deadline - time.perf_counter()))
    task = progress.add_task("feature draft: training", total=total)
    t0 = time.perf_counter()

    last_line = [time.perf_counter()]

    def on_step(step, value, rate):
        progress.update(task, completed=step if max_steps else min(total, time.perf_counter() - t0),
                        description=f"feature draft: training (loss {value:.3f})")
        if not console.is_terminal and time.perf_counter() - last_line[0] > 60:  # logs: a line a minute
            last_line[0] = time.perf_counter()
            left = "" if max_steps else f", about {max(0.0, train_deadline - time.perf_counter()):.0f} s left"
            say(f"feature draft: training step {step}, loss {value:.4f}, lr {rate:.2e}, "
                f"{time.perf_counter() - t0:.0f} s{left}")

    trained = fd.train_feature_draft(draft, samples, deadline=train_deadline, max_steps=max_steps, seed=seed,
                                     on_step=on_step)
    progress.update(task, completed=total)
    progress.stop()
    timings["train"] = trained["seconds"]
    after = fd.chained_agreement(draft, held, kept)
    train_fit = fd.chained_agreement(draft, samples[: len(held)], kept)
    say(f"after:  held-out top-1 agreement {after['top1']:.3f}, per draft position {after['per_position']}, "
        f"chained mean accepted at k=4 {after['mean_accepted']:.2f} (training prompts: top-1 {train_fit['top1']:.3f})")
    timings["total"] = round(time.perf_counter() - started, 1)
    report.update({
        "train_prompts": len(samples), "heldout_prompts": len(held),
        "train_tokens": sum(len(s.continuation) for s in samples),
        "train_positions": sum(len(s.ids) - 2 for s in samples),
        "heldout_tokens": sum(len(s.continuation) for s in held),
        "draft_layers": 1, "draft_kind": "feature",
        "draft_vocab": int(len(kept)) if kept is not None else 0,
        "draft_vocab_coverage_heldout": round(coverage(held, kept), 4),
        "before": {"top1_agreement": before["top1"], "chained": before},
        "after": {"top1_agreement": after["top1"], "chained": after}, "train_top1_after": train_fit["top1"],
        "training": trained, "seconds": timings})
    shell = fd.as_transformers(draft, shell_config)
    publish_draft(shell, tokenizer, out, kept, report, force, also=lambda folder: fd.save_feature_draft(draft, folder))
    say(f"saved the feature draft to {out} ({timings['total']:.0f} s in all); build with: "
        f"build-engines --target {report['target']} --draft {out}")
    return report


def _engine_continuations(engine, progress, train_ids, held_ids, deadline, generate_share, max_new_tokens,
                          temperature, samples_per_prompt, sample_temperature, top_k, eos, seed, batch,
                          features=False):
    """(training samples, held-out samples) from the ONNX engine, teacher rows included; the extra sampled
    continuations come pass after pass, so the deadline cuts the last pass, never a prompt's first one, and only the
    first carries the prompt's own rows."""
    held = generate_with_engine(engine, [Job(p) for p in held_ids], max_new_tokens, top_k=top_k, eos_ids=eos,
                                seed=seed, batch_size=batch, features=features,
                                advance=_task(progress, "target: held-out continuations", len(held_ids)))
    gen_deadline = time.perf_counter() + generate_share * max(0.0, deadline - time.perf_counter())
    jobs = [Job(p, temperature) for p in train_ids]
    jobs += [Job(p, sample_temperature, prompt_rows=False) for _ in range(1, samples_per_prompt) for p in train_ids]
    samples = generate_with_engine(engine, jobs, max_new_tokens, top_k=top_k, eos_ids=eos, seed=seed + 1,
                                   batch_size=batch, deadline=gen_deadline, features=features,
                                   advance=_task(progress, "target: training continuations", len(jobs),
                                                 gen_deadline))
    return samples, held


def _torch_continuations(model, progress, train_ids, held_ids, deadline, generate_share, max_new_tokens, temperature,
                         samples_per_prompt, sample_temperature, eos, pad, seed, batch):
    """(training samples, held-out samples) from torch's ``generate``; the teacher rows come after, in one pass."""
    held = generate(model, held_ids, max_new_tokens, temperature=0.0, seed=seed, eos_ids=eos, pad_id=pad,
                    batch_size=batch, advance=_task(progress, "target: held-out continuations", len(held_ids)))
    gen_deadline = time.perf_counter() + generate_share * max(0.0, deadline - time.perf_counter())
    samples = generate(model, train_ids, max_new_tokens, temperature=temperature, seed=seed, eos_ids=eos,
                       pad_id=pad, batch_size=batch, deadline=gen_deadline,
                       advance=_task(progress, "target: training continuations", len(train_ids), gen_deadline))
    for extra in range(1, samples_per_prompt):
        if time.perf_counter() > gen_deadline:
            break
        samples += generate(model, train_ids, max_new_tokens, temperature=sample_temperature, seed=seed + extra,
                            eos_ids=eos, pad_id=pad, batch_size=batch, deadline=gen_deadline,
                            advance=_task(progress, f"target: sampled continuations {extra + 1}", len(train_ids),
                                          gen_deadline))
    return samples, held


def _task(progress, what: str, total: int, deadline: float = math.inf) -> Heartbeat:
    """A bar for a stage of ``total`` items on a terminal; in a log, where no bar shows, a line a minute."""
    task = progress.add_task(what, total=total)
    console = progress.console
    return Heartbeat(what, total, None if console.is_terminal else console.print,
                     lambda n: progress.advance(task, n), deadline)


def _progress(console, quiet: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    return Progress(TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, disable=quiet, transient=False)
