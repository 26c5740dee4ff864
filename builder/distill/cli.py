"""``draftsmith distill``: a thin command over ``distill_draft``; its flags and a preset's ``distill:`` block build
the ``DistillRecipe`` (builder/distill/recipe.py)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from builder.distill.corpus import DistillError
from builder.distill.pipeline import distill_draft
from builder.distill.recipe import DistillRecipe, recipe_from
from builder.distill.save import REPORT_FILE, is_distilled
from runtime.bundle import SpecError
from runtime.presets import load_preset


@click.command("distill")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A preset with a 'distill:' recipe: distil its target into its 'draft' folder with the recipe's "
    "options (flags given here override them); a folder already distilled is kept unless --force.",
)
@click.option("--target", help="Target checkpoint: HF folder, .gguf file or pkg:<package>/<file>.")
@click.option(
    "--init",
    "init",
    default="layers=4",
    show_default=True,
    help="layers=N (the target's first N layers, embeddings and head), feature (one layer drafting from "
    "the target's own hidden states, EAGLE-style: ONNX teacher engine only) or a draft checkpoint to "
    "start from.",
)
@click.option("--out", type=click.Path(), help="Folder for the draft (HF format, safetensors).")
@click.option(
    "--prompts",
    type=click.Path(),
    default=None,
    help="Prompt file ('---'-separated blocks or one per line; '@completion' first line: raw text). "
    "Default: the shipped corpus.",
)
@click.option(
    "--continuations",
    type=int,
    default=0,
    show_default=True,
    help="Training continuations the target makes, pass after pass over the prompts (0: every training prompt "
    "--samples-per-prompt times).",
)
@click.option(
    "--train-steps",
    type=int,
    default=0,
    show_default=True,
    help="Training steps (0: 600, or from the deprecated --minutes). The recipe is work, never time: a slower or "
    "busier machine makes the same draft, later; the plan and its expected time are printed first.",
)
@click.option(
    "--prefill-windows",
    type=int,
    default=0,
    show_default=True,
    help="With --prefill-text: the windows the target's engine reads (0: 96, or from the deprecated --minutes).",
)
@click.option(
    "--minutes",
    type=float,
    default=None,
    help="Deprecated: no longer a time limit. Work amounts left at 0 are translated from it at fixed rates "
    "(docs/drafts.md), split by --generate-share and --prefill-share.",
)
@click.option("--max-new-tokens", type=int, default=64, show_default=True, help="Target tokens per prompt.")
@click.option(
    "--temperature",
    type=float,
    default=0.0,
    show_default=True,
    help="Target sampling temperature for the training continuations (0: greedy).",
)
@click.option(
    "--loss",
    type=click.Choice(["kl", "tokens"]),
    default="kl",
    show_default=True,
    help="kl: KL(target || draft) on the target's top-k probabilities; tokens: cross-entropy on its tokens.",
)
@click.option(
    "--draft-vocab",
    type=int,
    default=0,
    show_default=True,
    help="Keep only the N most frequent target tokens in the draft's head (0: full head).",
)
@click.option(
    "--samples-per-prompt",
    type=int,
    default=1,
    show_default=True,
    help="Continuations per training prompt: the first at --temperature, the others sampled at "
    "--sample-temperature, pass after pass (more distinct text, less overfitting); --continuations cuts the last pass.",
)
@click.option(
    "--sample-temperature", type=float, default=1.0, show_default=True, help="Temperature of the extra continuations."
)
@click.option(
    "--generate-share",
    type=float,
    default=0.4,
    show_default=True,
    help="With the deprecated --minutes: its share for data (the rest: training).",
)
@click.option(
    "--teacher-engine",
    type=click.Choice(["auto", "gguf", "fp32", "torch"]),
    default="auto",
    show_default=True,
    help="What continues the prompts and gives the teacher rows: the target's fused ONNX engine (auto: the "
    "GGUF file's own blocks for a .gguf target, else fp32) in continuous batches, or torch.",
)
@click.option(
    "--generate-batch", type=int, default=32, show_default=True, help="Rows the ONNX engine continues at once."
)
@click.option(
    "--self-prompts",
    type=int,
    default=0,
    show_default=True,
    help="Have the target write N user queries from its chat template's user-turn prefix (Magpie) and "
    "train on them too (chat models; the held-out prompts stay the shipped ones).",
)
@click.option(
    "--prefill-text",
    multiple=True,
    default=(),
    help="Feature drafts: a text source the target's engine reads whole (batched prefill) for training pairs: "
    "python:PACKAGE (an installed package's files), a file or a folder (repeatable). With it the data and "
    "training are kept in --work and a killed run resumes.",
)
@click.option("--prefill-length", type=int, default=512, show_default=True, help="Tokens a prefilled window.")
@click.option("--prefill-rows", type=int, default=1, show_default=True, help="Prefilled windows an engine call.")
@click.option(
    "--prefill-share",
    type=float,
    default=0.7,
    show_default=True,
    help="With the deprecated --minutes: the data share's part for prefilled windows (the rest: continuations).",
)
@click.option(
    "--draft-intermediate",
    type=int,
    default=0,
    show_default=True,
    help="A feature draft's MLP width (0: the target's; narrower drafts and trains faster).",
)
@click.option(
    "--heldout-prompts",
    multiple=True,
    default=(),
    help="Held-out prompts: heldout-code, heldout-chat (shipped) or a prompt file (repeatable; default: a "
    "--heldout share of the corpus).",
)
@click.option("--heldout", type=float, default=0.1, show_default=True, help="Share of prompts held out.")
@click.option(
    "--lr",
    type=float,
    default=5e-4,
    show_default=True,
    help="Peak learning rate of a layers=N draft (a feature draft trains at its own 3e-3).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=int, default=0, show_default=True, help="torch threads (0: torch's default).")
@click.option(
    "--work",
    type=click.Path(file_okay=False),
    default=None,
    help="With --prefill-text: the folder of the data, engine and checkpoints a killed run resumes from "
    "(default: OUT.work beside the draft).",
)
@click.option("--force", is_flag=True, help="Replace the draft folder at --out (only a model folder, or an empty one).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def distill(ctx, config_path, target, out, threads, work, force, as_json, **flags):
    """Train a draft to imitate TARGET on its own outputs; print acceptance before and after on held-out prompts."""
    from builder.checkpoint import CheckpointError

    recipe = DistillRecipe(**flags)  # the flags are RECIPE_KEYS, with the recipe's defaults
    if config_path is not None:
        try:
            recipe_target, recipe_out, preset = recipe_from(load_preset(config_path), config_path)
        except (DistillError, SpecError) as err:
            raise click.ClickException(str(err)) from None
        given = {
            name: flags[name]
            for name in flags
            if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE
        }
        recipe = preset.overridden(given)  # flags override the recipe
        target, out = target or recipe_target, out or recipe_out
        if is_distilled(Path(out)) and not force:
            click.echo(
                f"{out} already holds a distilled draft ({REPORT_FILE}); keeping it (--force redoes it)", err=True
            )
            return
    if not target or not out:
        raise click.UsageError("give --target and --out, or --config PRESET with a 'distill:' recipe")
    try:
        report = distill_draft(recipe, target, out, threads=threads, force=force, work=work)
    except (DistillError, CheckpointError) as err:
        raise click.ClickException(str(err)) from None
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    b, a = report["before"], report["after"]
    click.echo(
        f"held-out top-1 agreement: {b['top1_agreement']:.3f} -> {a['top1_agreement']:.3f} "
        f"({report['heldout_prompts']} prompts, {report['heldout_tokens']} target tokens)"
    )
    if "chained" in a:  # a feature draft: its chained greedy agreement per draft position
        click.echo(
            f"chained greedy agreement per draft position: {b['chained']['per_position']} -> "
            f"{a['chained']['per_position']} (expected accepted tokens at k=4: "
            f"{b['chained']['mean_accepted']:.2f} -> {a['chained']['mean_accepted']:.2f})"
        )
    for k in ("2", "3", "4") if "greedy" in a else ():
        click.echo(
            f"greedy acceptance k={k}: {b['greedy'][k]['acceptance']:.3f} -> {a['greedy'][k]['acceptance']:.3f}"
            f"  (tokens/step {b['greedy'][k]['tokens_per_step']:.2f} -> {a['greedy'][k]['tokens_per_step']:.2f};"
            f" per-position alpha {a['greedy'][k]['alpha']})"
        )
    click.echo(f"time: {report['seconds']}")
