"""What every distillation flow shares: the run (recipe, its work plan, console, timings), its progress bars and
lines, the report's common fields and the feature draft's publication. ``builder/distill/pipeline.py`` runs the
flows that keep their data in memory, ``builder/distill/resumable.py`` the one that keeps it on disk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from builder.distill.corpus import DistillError
from builder.distill.draft import check_init, coverage, output_transform
from builder.distill.plan import Work
from builder.distill.recipe import DistillRecipe
from builder.distill.save import publish_draft
from builder.progress import Heartbeat

RATE_STEPS = 10  # training steps the rate is first measured over (after the first, which warms up)


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
    """One distillation's recipe, what is not recipe, its work plan (builder/distill/plan.py: set once the prompts
    are read) and the timings, handed from step to step."""

    recipe: DistillRecipe
    target: str
    out: Path
    force: bool
    threads: int
    console: object
    started: float
    timings: dict = field(default_factory=dict)
    work: Work | None = None
    expected: dict = field(default_factory=dict)  # each stage's expected seconds (plan.expected_seconds)

    def plan(self, config, train_prompts: int, heldout: int, draft_config=None) -> Work:
        """The recipe's work for these prompts and its expected time, said before anything slow runs."""
        from builder.distill import plan

        self.work, why = plan.plan(self.recipe, train_prompts, heldout)
        plan.check_work(self.work)
        macs = plan.draft_macs(self.recipe, config, draft_config)
        self.expected = plan.expected_seconds(self.work, config, macs, features=self.recipe.features)
        plan.say_plan(self.say, self.work, why, self.expected, self.recipe)
        return self.work

    def measured_generation(self, tokens: int, seconds: float, config) -> None:
        """After the held-out continuations (the first the target makes): the rate this machine gave and the data
        stages' time at that rate."""
        from builder.distill import plan

        if not tokens or seconds <= 0 or self.work is None:
            return
        rate = tokens / seconds
        at_rate = plan.expected_seconds(self.work, config, 0, generate_rate=rate)
        later = sum(at_rate.get(name, 0.0) for name in ("self_prompts", "continuations"))
        reference = plan.expected_seconds(self.work, config, 0)
        ratio = reference["heldout"] / at_rate["heldout"] if at_rate.get("heldout") else 1.0
        self.say(
            f"distill: the target made {rate:.0f} tokens/s on the held-out continuations ({ratio:.2f}x the "
            f"reference rate): the training continuations (and self-written prompts) expected in about {later:.0f} s"
        )

    def say(self, text: str) -> None:
        self.console.print(text)

    def lap(self, name: str, since: float) -> None:
        """The seconds since ``since``, as the report's timing ``name``."""
        self.timings[name] = round(time.perf_counter() - since, 1)


def task(progress, what: str, total: int) -> Heartbeat:
    """A bar for a stage of ``total`` items on a terminal; in a log, where no bar shows, a line a minute."""
    task = progress.add_task(what, total=total)
    console = progress.console
    return Heartbeat(what, total, None if console.is_terminal else console.print, lambda n: progress.advance(task, n))


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


def training_bar(run: Run, progress, what: str, steps: int, line, clock=None):
    """(on_step, done) for a training loop of ``steps`` steps: a bar on a terminal; once, after its first
    ``RATE_STEPS`` steps, the rate measured and the time the rest will take; in a log, where no bar shows,
    ``line(step, loss, lr, seconds)`` and the time left once a minute."""
    clock = clock or (lambda: time.perf_counter())
    task = progress.add_task(what, total=steps)
    t0 = clock()
    last_line = [t0]
    first = [None]  # (step, time) of the first step: the rate leaves out the first step's warm-up

    def left(step: int, now: float) -> float | None:
        if first[0] is None or step <= first[0][0]:
            return None
        return (now - first[0][1]) / (step - first[0][0]) * (steps - step)

    def on_step(step, value, rate):
        now = clock()
        progress.update(task, completed=step, description=f"{what} (loss {value:.3f})")
        if first[0] is None:
            first[0] = (step, now)
        elif step - first[0][0] == RATE_STEPS and step < steps:
            per_step = (now - first[0][1]) / RATE_STEPS
            expected = run.expected.get("training")
            reference = f" (the plan expected {expected / run.work.train_steps:.2f} s)" if expected and run.work else ""
            run.say(
                f"{what}: {per_step:.2f} s a step measured over steps {first[0][0] + 1}-{step}{reference}: the "
                f"other {steps - step:,} of {steps:,} steps in about {per_step * (steps - step):.0f} s"
            )
        if not run.console.is_terminal and now - last_line[0] > 60:  # logs: a line a minute
            last_line[0] = now
            remaining = left(step, now)
            tail = f", step {step}/{steps}" + (f", about {remaining:.0f} s left" if remaining is not None else "")
            run.say(line(step, value, rate, now - t0) + tail)

    return on_step, lambda: progress.update(task, completed=steps)


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
    from builder.distill.training import chained_agreement

    after = after or chained_agreement(draft, held, kept)
    train_fit = chained_agreement(draft, samples[: len(held)], kept)
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
        "work": run.work.to_dict() if run.work else None,
        "expected_seconds": run.expected,
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
