"""The feature distillation that fits a large target on a small machine: its pairs from the target's own engine,
mostly in batched prefill, kept on disk, and a killed run resumed where it stopped (``prefill_text`` in the recipe).

In order, under the recipe's ``minutes`` (counted over every run of the same work folder):

1. the target's engine (builder/distill/engine_pairs.py: a GGUF file written layer by layer from its own blocks, so
   the target is never whole in torch fp32);
2. the greedy continuations of the held-out prompts (``heldout_prompts``: sets no training text holds);
3. pairs for ``generate_share`` of the budget: continuations of the training prompts in continuous batches (the
   first at ``temperature``, the others sampled at ``sample_temperature``) for ``1 - prefill_share`` of that time,
   then windows of ``prefill_text`` in batched prefill for the rest
   (builder/distill/prefill.py) -- each sample the target's hidden state at every position, in shards on disk;
4. the reduced vocabulary (the ``draft_vocab`` most frequent tokens of all that text), the draft, training with a
   checkpoint every few minutes (builder/distill/checkpoints.py), its chained agreement on the held-out
   continuations per set, and the published folder.
"""

from __future__ import annotations

import math
import resource
import time
from pathlib import Path

from builder.distill import engine_pairs as pairs
from builder.distill.continuations import Job, eos_ids_of
from builder.distill.corpus import DistillError, encode, load_heldout, load_prompts, split_prompts
from builder.distill.draft import coverage, kept_vocabulary
from builder.distill.prefill import text_files, text_windows
from builder.distill.run import Run, check_target, progress_bars, publish_features, task, training_bar
from runtime.engines import gguf_ops

# tokens a second of prefill time the windows are planned for: more than 2 cores prefill a 1.5B target (~100)
PLANNED_TOKENS_PER_SECOND = 300


def distill_resumable(run: Run, quiet: bool, work: str | Path | None) -> dict:
    """The flow of the module docstring for ``run``; ``work``: the work folder (None: OUT.work beside the draft)."""
    from builder import checkpoint as ckpt

    recipe = run.recipe
    train_prompts, held_sets = _prompts(run)
    checkpoint = ckpt.resolve(run.target)
    check_target(checkpoint.config, recipe.init)
    tokenizer = checkpoint.load_tokenizer()
    sha = checkpoint.sha256()
    context = max(recipe.max_prompt_tokens + recipe.max_new_tokens, recipe.prefill_length) + 8
    native = gguf_ops.native_for(recipe.gguf_kernel)  # the bundle's target engine's kernel: its hidden states
    source = pairs.teacher_source(checkpoint, context, recipe.accuracy_level, native)
    folder = Path(work) if work else run.out.with_name(run.out.name + ".work")
    clock = pairs.WorkFolder(folder, {"target": sha, "recipe": _data_recipe(recipe), "kernel": source.kernel})
    run.say(f"distill: work folder {folder} ({clock.before:.0f} s spent there by earlier runs)")
    run.say(f"teacher: the target's fused engine, its weights multiplied by {source.kernel}")
    eos = eos_ids_of(source.reference, tokenizer)

    def ids(prompts):
        return [encode(tokenizer, p, recipe.chat, recipe.max_prompt_tokens) for p in prompts]

    encoded = {name: ids(prompts) for name, prompts in held_sets}
    train_ids = ids(train_prompts)
    with progress_bars(run.console, quiet) as progress:
        engine = pairs.teacher_engine(clock, source, sha, context, run.threads, None if quiet else run.say)
        run.timings["engine_ready_at"] = round(clock.elapsed(), 1)
        held = _heldout(run, clock, engine, encoded, eos, progress)
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
    clock.reset()  # and the next run of the folder has its whole budget
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
    keys = ("prompts", "max_new_tokens", "samples_per_prompt", "sample_temperature", "prefill_text")
    keys += ("prefill_length", "heldout_prompts", "heldout", "seed", "accuracy_level", "max_prompt_tokens")
    return {key: getattr(recipe, key) if key != "prompts" else recipe.prompts_name for key in keys}


def _heldout(run: Run, clock, engine, encoded: dict, eos, progress) -> dict:
    """Each held-out set's greedy continuations (made once, kept in the work folder)."""
    recipe, held = run.recipe, {}
    t0 = time.perf_counter()
    for name, ids in encoded.items():
        store = clock.store(f"heldout-{name}", {"set": name, "prompts": pairs.sha_of(ids)})
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
    run.lap("heldout", t0)
    return held


def _pairs(run: Run, clock, engine, tokenizer, train_ids, eos, held_sets, progress) -> list:
    """The stores of sampled continuations and prefilled windows, filled until the data share of the budget."""
    recipe = run.recipe
    budget = recipe.minutes * 60
    ready = clock.elapsed()
    data_end = min(budget, ready + recipe.generate_share * max(0.0, budget - ready))
    generated = clock.store("generated", {"prompts": pairs.sha_of(train_ids)})
    # pass after pass over the prompts: a deadline cuts the last pass, never a prompt's first sample
    temperatures = [recipe.temperature] + [recipe.sample_temperature] * (recipe.samples_per_prompt - 1)
    jobs = [Job(p, t, prompt_rows=False) for t in temperatures for p in train_ids]
    t0 = time.perf_counter()
    sampled_until = clock.deadline(ready + (1 - recipe.prefill_share) * max(0.0, data_end - ready))
    if recipe.prefill_share < 1 and time.perf_counter() < sampled_until:
        pairs.continue_into(
            generated,
            engine,
            jobs,
            max_new_tokens=recipe.max_new_tokens,
            eos_ids=eos,
            seed=recipe.seed + 1,
            batch_size=recipe.generate_batch,
            deadline=sampled_until,
            advance=task(progress, "target: sampled continuations", len(jobs), sampled_until),
            on_shard=clock.save_clock,
        )
    run.lap("generate", t0)
    t0 = time.perf_counter()
    prefilled = _prefill(run, clock, engine, tokenizer, held_sets, clock.deadline(data_end), progress)
    run.lap("prefill", t0)
    if not generated.shards and not prefilled.shards:
        raise DistillError("the budget ran out before any training pair was made; raise --minutes")
    return [generated, prefilled]


def _prefill(run: Run, clock, engine, tokenizer, held_sets, deadline: float, progress):
    """The prefilled windows of ``prefill_text``, made until ``deadline``: planned from the recipe alone (a resumed
    run plans the same windows) for more than the data share of the budget can prefill."""
    recipe = run.recipe
    files = text_files(list(recipe.prefill_text))
    exclude = [p.text for _, prompts in held_sets for p in prompts]
    data_seconds = recipe.generate_share * recipe.minutes * 60
    planned = PLANNED_TOKENS_PER_SECOND * recipe.prefill_share * data_seconds / recipe.prefill_length
    count = recipe.prefill_rows * max(1, math.ceil(planned / recipe.prefill_rows))
    windows = text_windows(tokenizer, files, recipe.prefill_length, count, seed=recipe.seed, exclude=exclude)
    store = clock.store("prefill", {"windows": pairs.sha_of(windows)})
    left = len(windows) - len(store.done())
    run.say(f"prefill: {len(windows)} windows of {recipe.prefill_length} tokens planned from {len(files)} files")
    if left and time.perf_counter() < deadline:
        pairs.prefill_into(
            store,
            engine,
            windows,
            rows=recipe.prefill_rows,
            deadline=deadline,
            advance=task(progress, "target: prefilled windows", left, deadline),
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
    from builder.distill import feature_draft as fd

    by_set = {name: fd.chained_agreement(draft, samples, kept) for name, samples in held.items()}
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
    """Train until the budget's end less the final measurement's reserve, checkpointing as it goes."""
    from builder.distill import feature_draft as fd

    recipe = run.recipe
    dtype = fd.matmul_dtype()  # what the products read while training; the draft stays float32
    run.say(f"feature draft: training with {dtype} matrix products (weights, gradients and the saved draft float32)")
    reserve = 60.0 + 0.02 * recipe.minutes * 60  # the measurement after training and the save
    train_deadline = clock.deadline(recipe.minutes * 60 - reserve)
    if recipe.max_steps is None and train_deadline <= time.perf_counter():
        raise DistillError("no time left to train within --minutes; raise it")
    on_step, done = training_bar(
        run,
        progress,
        "feature draft: training",
        train_deadline,
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
        "minutes": recipe.minutes,
        "dtype": dtype,
    }
    trained = fd.train_feature_draft(
        draft,
        samples,
        deadline=train_deadline,
        max_steps=recipe.max_steps,
        seed=recipe.seed,
        on_step=step,
        checkpoint=(clock.path, {**clock.fingerprint, **fingerprint}),
        save_every=recipe.checkpoint_seconds,
        dtype=dtype,
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
