"""The feature distillation that fits a large target on a small machine: its pairs from the target's own engine,
mostly in batched prefill, kept on disk, and a killed run resumed where it stopped (``prefill_text`` in the recipe).

In order, each stage for the work the recipe plans (builder/distill/plan.py: fixed by the recipe, said with its
expected time before anything slow runs; no clock stops a stage, so a killed and resumed run, or a slow machine,
ends on the draft an unbroken run on a quiet machine makes):

1. the target's engine (builder/distill/engine_pairs.py: a GGUF file written layer by layer from its own blocks, so
   the target is never whole in torch fp32);
2. the greedy continuations of the held-out prompts (``heldout_prompts``: sets no training text holds);
3. pairs: ``continuations`` of the training prompts in continuous batches (pass after pass: the first at
   ``temperature``, the others sampled at ``sample_temperature``), then ``prefill_windows`` windows of
   ``prefill_text`` in batched prefill (builder/distill/prefill.py) -- each sample the target's hidden state at
   every position, in shards on disk;
4. the reduced vocabulary (the ``draft_vocab`` most frequent tokens of all that text), the draft, ``train_steps``
   of training with a checkpoint every few minutes (builder/distill/checkpoints.py), its chained agreement on the
   held-out continuations per set, and the published folder.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

from builder.distill import engine_pairs as pairs
from builder.distill import plan
from builder.distill.continuations import Job, eos_ids_of
from builder.distill.corpus import DistillError, encode, load_heldout, load_prompts, split_prompts
from builder.distill.draft import coverage, kept_vocabulary
from builder.distill.prefill import text_files, text_windows
from builder.distill.run import Run, check_target, progress_bars, publish_features, task, training_bar
from runtime.engines import gguf_ops


def distill_resumable(run: Run, quiet: bool, work: str | Path | None) -> dict:
    """The flow of the module docstring for ``run``; ``work``: the work folder (None: OUT.work beside the draft)."""
    from builder import checkpoint as ckpt

    recipe = run.recipe
    train_prompts, held_sets = _prompts(run)
    checkpoint = ckpt.resolve(run.target)
    check_target(checkpoint.config, recipe.init)
    run.plan(checkpoint.config, len(train_prompts), sum(len(prompts) for _, prompts in held_sets))
    tokenizer = checkpoint.load_tokenizer()
    sha = checkpoint.sha256()
    context = max(recipe.max_prompt_tokens + recipe.max_new_tokens, recipe.prefill_length) + 8
    native = gguf_ops.native_for(recipe.gguf_kernel)  # the bundle's target engine's kernel: its hidden states
    source = pairs.teacher_source(checkpoint, context, recipe.accuracy_level, native)
    folder = Path(work) if work else run.out.with_name(run.out.name + ".work")
    clock = pairs.WorkFolder(folder, {"target": sha, "recipe": _data_recipe(recipe), "kernel": source.kernel})
    run.say(f"distill: work folder {folder} ({clock.before:.0f} s spent there by earlier runs of this recipe)")
    run.say(f"teacher: the target's fused engine, its weights multiplied by {source.kernel}")
    eos = eos_ids_of(source.reference, tokenizer)

    def ids(prompts):
        return [encode(tokenizer, p, recipe.chat, recipe.max_prompt_tokens) for p in prompts]

    encoded = {name: ids(prompts) for name, prompts in held_sets}
    train_ids = ids(train_prompts)
    with progress_bars(run.console, quiet) as progress:
        engine = pairs.teacher_engine(clock, source, sha, context, run.threads, None if quiet else run.say)
        run.timings["engine_ready_at"] = round(clock.elapsed(), 1)
        held = _heldout(run, clock, engine, encoded, eos, progress, source.reference.config)
        data = _pairs(run, clock, engine, tokenizer, train_ids, eos, held_sets, progress)
        engine = None  # its session's memory goes before training
        samples = [s for store in data for s in store.samples()]
        kept = _vocabulary(run, tokenizer, source, samples, eos)
        draft = _draft(run, source, kept, sha)
        shell_config, engine_kernel = source.reference.config, source.kernel
        source = None  # the target's rows the draft copied: their memory goes before training
        before = _measure(draft, held, kept)
        trained = _train(run, clock, draft, samples, kept, progress)
    after = _measure(draft, held, kept)
    extra = {**_resumable_fields(run, clock, held, kept, before, after, data), "teacher_kernel": engine_kernel}
    all_held = [s for part in held.values() for s in part]
    report = publish_features(
        run, tokenizer, draft, shell_config, samples, all_held, kept, before["all"], trained, 0, extra, after["all"]
    )
    from builder.distill import checkpoints

    checkpoints.remove(clock.path)  # published: the data stays for another recipe's training
    clock.reset()  # and the next run of the folder counts its own seconds
    return report


def _prompts(run: Run):
    """(training prompts, [(held-out set name, prompts)]): the corpus whole when held-out sets are named (they are
    apart from it), else a ``heldout`` share of it as the one set."""
    recipe = run.recipe
    corpus = load_prompts(recipe.prompts)
    if recipe.heldout_prompts:
        sets = [(name, load_heldout([name])) for name in recipe.heldout_prompts]
        train = corpus
    else:
        train, held = split_prompts(corpus, recipe.heldout, recipe.seed)
        sets = [("heldout", held)]
    run.say(
        f"distill: {len(train)} training prompts from {recipe.prompts_name}; held out: "
        + ", ".join(f"{name} ({len(ps)})" for name, ps in sets)
    )
    return train, sets


def _data_recipe(recipe) -> dict:
    """What the data depends on (a work folder made for other values starts afresh)."""
    keys = ("prompts", "max_new_tokens", "samples_per_prompt", "sample_temperature", "temperature", "prefill_text")
    keys += ("prefill_length", "heldout_prompts", "heldout", "seed", "accuracy_level", "max_prompt_tokens")
    return {key: getattr(recipe, key) if key != "prompts" else recipe.prompts_name for key in keys}


def _heldout(run: Run, clock, engine, encoded: dict, eos, progress, config) -> dict:
    """Each held-out set's greedy continuations (made once, kept in the work folder); where this run made them, the
    rate it made them at and the time the training continuations will take at it."""
    recipe, held = run.recipe, {}
    t0 = time.perf_counter()
    made = 0  # tokens this run made (a set found whole in the work folder says nothing of this machine)
    for name, ids in encoded.items():
        store = clock.store(f"heldout-{name}", {"set": name, "prompts": pairs.sha_of(ids)})
        fresh = not store.done()
        pairs.continue_into(
            store,
            engine,
            [Job(p) for p in ids],
            max_new_tokens=recipe.max_new_tokens,
            eos_ids=eos,
            seed=recipe.seed,
            batch_size=recipe.generate_batch,
            advance=task(progress, f"target: held-out {name}", len(ids) - len(store.done())),
            on_shard=clock.save_clock,
        )
        held[name] = store.samples()
        made += sum(len(s.continuation) for s in held[name]) if fresh else 0
    run.lap("heldout", t0)
    run.measured_generation(made, run.timings["heldout"], config)
    return held


def _pairs(run: Run, clock, engine, tokenizer, train_ids, eos, held_sets, progress) -> list:
    """The stores of the planned continuations and prefilled windows (those a killed run made are kept)."""
    recipe = run.recipe
    # pass after pass over the prompts: the plan's count cuts the last pass, never a prompt's first sample
    temperatures = [recipe.temperature] + [recipe.sample_temperature] * (recipe.samples_per_prompt - 1)
    jobs = [Job(p, t, prompt_rows=False) for t in temperatures for p in train_ids][: run.work.continuations]
    generated = clock.store("generated", {"prompts": pairs.sha_of(train_ids), "continuations": len(jobs)})
    t0 = time.perf_counter()
    left = len(jobs) - len(generated.done())
    if left > 0:
        pairs.continue_into(
            generated,
            engine,
            jobs,
            max_new_tokens=recipe.max_new_tokens,
            eos_ids=eos,
            seed=recipe.seed + 1,
            batch_size=recipe.generate_batch,
            advance=task(progress, "target: sampled continuations", left),
            on_shard=clock.save_clock,
        )
    run.lap("generate", t0)
    t0 = time.perf_counter()
    prefilled = _prefill(run, clock, engine, tokenizer, held_sets, progress)
    run.lap("prefill", t0)
    return [generated, prefilled]


def _prefill(run: Run, clock, engine, tokenizer, held_sets, progress):
    """The planned windows of ``prefill_text`` (chosen from the recipe alone: a resumed run plans the same ones)."""
    recipe = run.recipe
    files = text_files(list(recipe.prefill_text))
    exclude = [p.text for _, prompts in held_sets for p in prompts]
    count = run.work.prefill_windows
    windows = text_windows(tokenizer, files, recipe.prefill_length, count, seed=recipe.seed, exclude=exclude)
    store = clock.store("prefill", {"windows": pairs.sha_of(windows)})
    left = len(windows) - len(store.done())
    run.say(
        f"prefill: {len(windows)} windows of {recipe.prefill_length} tokens from {len(files)} files"
        + (f" (the text holds no more than that of the {count} planned)" if len(windows) < count else "")
    )
    if left:
        pairs.prefill_into(
            store,
            engine,
            windows,
            rows=recipe.prefill_rows,
            advance=task(progress, "target: prefilled windows", left),
            on_shard=clock.save_clock,
        )
    return store


def _vocabulary(run: Run, tokenizer, source, samples, eos):
    size = run.recipe.draft_vocab
    if not size:
        return None
    vocab = min(len(tokenizer), source.reference.get_output_embeddings().weight.shape[0])
    if size >= vocab:
        raise DistillError(f"--draft-vocab {size} is not smaller than the vocabulary ({vocab})")
    return kept_vocabulary(samples, size, vocab, eos)


def _draft(run: Run, source, kept, sha: str):
    from builder.distill import feature_draft as fd

    return fd.init_feature_draft(source.reference, kept, sha, run.recipe.draft_intermediate)


def _measure(draft, held: dict, kept) -> dict:
    """Chained agreement on each held-out set, and on all of them (pooled by positions, not measured again: on a
    1.5B target's draft each pass over the held-out text takes a minute of the budget)."""
    from builder.distill.training import chained_agreement

    by_set = {name: chained_agreement(draft, samples, kept) for name, samples in held.items()}
    positions = sum(m["positions"] for m in by_set.values())
    per_position = [
        round(sum(m["per_position"][j] * m["positions"] for m in by_set.values()) / max(positions, 1), 4)
        for j in range(len(next(iter(by_set.values()))["per_position"]))
    ]
    pooled = {
        "top1": per_position[0],
        "per_position": per_position,
        "mean_accepted": round(sum(per_position), 3),
        "positions": positions,
    }
    return {"all": pooled, **by_set}


def _train(run: Run, clock, draft, samples, kept, progress) -> dict:
    """Train for the planned steps, checkpointing as it goes (a resumed run ends on the unbroken run's weights)."""
    from builder.distill.training import matmul_dtype, train_feature_draft

    recipe = run.recipe
    dtype = matmul_dtype()  # what the products read while training; the draft stays float32
    run.say(f"feature draft: training with {dtype} matrix products (weights, gradients and the saved draft float32)")
    steps = run.work.train_steps
    on_step, done = training_bar(
        run,
        progress,
        "feature draft: training",
        steps,
        lambda step, value, rate, s: f"feature draft: training step {step}, loss {value:.4f}, lr {rate:.2e}, {s:.0f} s",
    )

    def step(n, value, rate):
        on_step(n, value, rate)
        if n % 20 == 0:
            clock.save_clock()

    fingerprint = {
        "data": [len(samples), sum(len(s.ids) for s in samples)],
        "kept": pairs.sha_of(kept if kept is not None else []),
        "intermediate": recipe.draft_intermediate,
        "seed": recipe.seed,
        "steps": steps,
        "dtype": dtype,
    }
    trained = train_feature_draft(
        draft,
        samples,
        steps=steps,
        seed=recipe.seed,
        on_step=step,
        checkpoint=(clock.path, {**clock.fingerprint, **fingerprint}),
        save_every=recipe.checkpoint_seconds,
        dtype=dtype,
        tokens_per_batch=plan.FEATURE_TOKENS_PER_BATCH,
    )
    done()
    progress.stop()
    run.timings["train"] = trained["seconds"]
    return trained


def _resumable_fields(run: Run, clock, held: dict, kept, before: dict, after: dict, data) -> dict:
    """The report's fields of this flow: per held-out set its coverage by the kept vocabulary and the draft's
    chained agreement before and after training, the data made, and the memory and time."""
    return {
        "heldout_sets": {
            name: {
                "prompts": len(samples),
                "tokens": sum(len(s.continuation) for s in samples),
                "draft_vocab_coverage": round(coverage(samples, kept), 4),
                "before": before[name],
                "after": after[name],
            }
            for name, samples in held.items()
        },
        "pairs": {
            "generated_samples": sum(len(s["lengths"]) for s in data[0].shards),
            "generated_tokens": data[0].tokens,
            "prefilled_windows": sum(len(s["lengths"]) for s in data[1].shards),
            "prefilled_tokens": data[1].tokens,
            "prefill_text": list(run.recipe.prefill_text),
            "prefill_length": run.recipe.prefill_length,
        },
        "draft_intermediate": run.recipe.draft_intermediate,
        "seconds_all_runs": round(clock.elapsed(), 1),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }
