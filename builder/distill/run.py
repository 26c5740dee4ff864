"""What every distillation flow shares: the run (recipe, budget, console, timings), its progress bars and lines, the
report's common fields and the feature draft's publication. ``builder/distill/pipeline.py`` runs the flows that keep
their data in memory, ``builder/distill/resumable.py`` the one that keeps it on disk.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from builder.distill.corpus import DistillError
from builder.distill.draft import check_init, coverage, output_transform
from builder.distill.recipe import DistillRecipe
from builder.distill.save import publish_draft
from builder.progress import Heartbeat


def check_target(config, init: str) -> int:
    """Everything ``init`` needs of the target's ``config``, checked before anything slow runs; returns what
    ``check_init`` does (the layer count of ``layers=N``, else 0)."""
    layers = check_init(init, config.num_hidden_layers)
    if init == "feature":
        from builder.distill.feature_draft import FeatureConfig  # torch-free until a feature draft is asked for

        FeatureConfig.of_target(config)  # refuses what a feature draft cannot follow
    elif output_transform(config):
        raise DistillError(
            f"--init {init}: the target's logits are not its head times its final hidden state "
            f"({output_transform(config)}), which the trainer assumes; use an int4 self-draft "
            "(build-engines --draft self)"
        )
    return layers


@dataclass
class Run:
    """One distillation's recipe, what is not recipe, and the timings, handed from step to step."""

    recipe: DistillRecipe
    target: str
    out: Path
    force: bool
    threads: int
    console: object
    started: float
    timings: dict = field(default_factory=dict)

    @property
    def deadline(self) -> float:
        """When the whole budget (``minutes``) is spent."""
        return self.started + self.recipe.minutes * 60

    def say(self, text: str) -> None:
        self.console.print(text)

    def lap(self, name: str, since: float) -> None:
        """The seconds since ``since``, as the report's timing ``name``."""
        self.timings[name] = round(time.perf_counter() - since, 1)


def task(progress, what: str, total: int, deadline: float = math.inf) -> Heartbeat:
    """A bar for a stage of ``total`` items on a terminal; in a log, where no bar shows, a line a minute."""
    task = progress.add_task(what, total=total)
    console = progress.console
    return Heartbeat(
        what, total, None if console.is_terminal else console.print, lambda n: progress.advance(task, n), deadline
    )


def progress_bars(console, quiet: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description:<40}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=quiet,
        transient=False,
    )


def training_bar(run: Run, progress, what: str, train_deadline: float, line):
    """(on_step, done) for a training loop: a bar on a terminal, by steps under ``max_steps`` else by seconds until
    ``train_deadline``; in a log, where no bar shows, ``line(step, loss, lr, seconds)`` once a minute."""
    max_steps = run.recipe.max_steps
    total = max_steps or max(1, int(train_deadline - time.perf_counter()))
    task = progress.add_task(what, total=total)
    t0 = time.perf_counter()
    last_line = [time.perf_counter()]

    def on_step(step, value, rate):
        progress.update(
            task,
            completed=step if max_steps else min(total, time.perf_counter() - t0),
            description=f"{what} (loss {value:.3f})",
        )
        if not run.console.is_terminal and time.perf_counter() - last_line[0] > 60:  # logs: a line a minute
            last_line[0] = time.perf_counter()
            run.say(line(step, value, rate, time.perf_counter() - t0))

    return on_step, lambda: progress.update(task, completed=total)


def data_fields(samples, held, train_positions: int) -> dict:
    """The report's counts of the training and held-out data, as both draft kinds' reports give them (in this
    order); ``train_positions`` is the kind's own count of trained positions."""
    return {
        "train_prompts": len(samples),
        "heldout_prompts": len(held),
        "train_tokens": sum(len(s.continuation) for s in samples),
        "train_positions": train_positions,
        "heldout_tokens": sum(len(s.continuation) for s in held),
    }


def sampling_fields(recipe, self_prompts_kept: int) -> dict:
    """The report's record of how the training continuations were made, as both draft kinds' reports give it."""
    return {
        "samples_per_prompt": recipe.samples_per_prompt,
        "sample_temperature": recipe.sample_temperature,
        "generate_share": recipe.generate_share,
        "teacher_engine": recipe.teacher_engine,
        "self_prompts": recipe.self_prompts,
        "self_prompts_kept": self_prompts_kept,
    }


def vocab_fields(held, kept) -> dict:
    """The report's draft vocabulary: its size (0: the full one) and how much of the held-out text it covers."""
    return {
        "draft_vocab": int(len(kept)) if kept is not None else 0,
        "draft_vocab_coverage_heldout": round(coverage(held, kept), 4),
    }


def publish_features(
    run: Run,
    tokenizer,
    draft,
    shell_config,
    samples,
    held,
    kept,
    before: dict,
    trained: dict,
    self_prompts_kept: int,
    extra: dict | None = None,
    after: dict | None = None,
) -> dict:
    """Measure the trained feature draft (held out, unless ``after`` holds that measure already, and on as many
    training prompts), write it and its transformers shell with the report (``extra``: the flow's own fields, last),
    and say how to build with it."""
    from builder.distill import feature_draft as fd

    after = after or fd.chained_agreement(draft, held, kept)
    train_fit = fd.chained_agreement(draft, samples[: len(held)], kept)
    run.say(
        f"after:  held-out top-1 agreement {after['top1']:.3f}, per draft position {after['per_position']}, "
        f"chained mean accepted at k=4 {after['mean_accepted']:.2f} (training prompts: top-1 "
        f"{train_fit['top1']:.3f})"
    )
    run.lap("total", run.started)
    recipe = run.recipe
    report = {
        "target": run.target,
        "init": recipe.init,
        "seed": recipe.seed,
        "minutes": recipe.minutes,
        "prompts": recipe.prompts_name,
        "max_new_tokens": recipe.max_new_tokens,
        **sampling_fields(recipe, self_prompts_kept),
        **data_fields(samples, held, sum(len(s.ids) - 2 for s in samples)),
        "draft_layers": 1,
        "draft_kind": "feature",
        **vocab_fields(held, kept),
        "before": {"top1_agreement": before["top1"], "chained": before},
        "after": {"top1_agreement": after["top1"], "chained": after},
        "train_top1_after": train_fit["top1"],
        "training": trained,
        "seconds": run.timings,
        **(extra or {}),
    }
    shell = fd.as_transformers(draft, shell_config)
    publish_draft(
        shell, tokenizer, run.out, kept, report, run.force, also=lambda folder: fd.save_feature_draft(draft, folder)
    )
    run.say(
        f"saved the feature draft to {run.out} ({run.timings['total']:.0f} s in all); build with: "
        f"build-engines --target {run.target} --draft {run.out}"
    )
    return report
