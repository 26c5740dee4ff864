"""The distillation's work plan (builder/distill/plan.py): each stage stops when its work is done, never when a clock
says so; the plan and its expected time are said before anything slow runs; the deprecated ``minutes`` is
translated into work at fixed rates; the shipped recipes give work amounts."""

from __future__ import annotations

import io
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
# SmolLM2-135M's shapes (the default preset's target), for the expected time of its recipe
SMOLLM2 = SimpleNamespace(
    hidden_size=576,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    intermediate_size=1536,
    num_hidden_layers=30,
    vocab_size=49152,
)


def _preset_recipe(name: str):
    from builder.distill.recipe import recipe_from

    path = ROOT / "configs" / name
    return recipe_from(yaml.safe_load(path.read_text()), path)[2]


def test_the_deprecated_minutes_translate_into_fixed_work_and_given_amounts_win():
    from builder.distill import plan
    from builder.distill.recipe import DistillRecipe

    # the default recipe before work budgets: 20 minutes, half of them for data, up to 16 samples a prompt
    old = DistillRecipe(init="feature", minutes=20, max_new_tokens=128, samples_per_prompt=16, generate_share=0.5)
    work, why = plan.plan(old, 187, 21)
    # 600 s of data at 212 tokens/s, 0.9 x 128 tokens a continuation; 600 s of training x 0.9 at a step a second
    assert (work.continuations, work.train_steps, work.batch_tokens) == (1104, 540, 2048)
    assert why == "from minutes 20" and plan.minutes_used(old)
    given = DistillRecipe(init="feature", minutes=20, continuations=500, train_steps=77, samples_per_prompt=16)
    assert plan.plan(given, 187, 21)[0].continuations == 500 and plan.train_steps(given) == 77
    assert not plan.minutes_used(given)
    # no minutes: every prompt samples_per_prompt times, the default steps; a count past that is capped
    plain = DistillRecipe(init="layers=2", samples_per_prompt=3)
    work, why = plan.plan(plain, 100, 10)
    assert (work.continuations, work.train_steps, work.batch_tokens) == (300, plan.DEFAULT_TRAIN_STEPS, 1024)
    assert why == "3 per prompt"
    capped, why = plan.continuation_count(DistillRecipe(continuations=400, samples_per_prompt=3), 100)
    assert capped == 300 and "capped" in why
    # a resumable recipe's windows: a whole number of calls
    windows = DistillRecipe(init="feature", prefill_text=("x",), prefill_windows=10, prefill_rows=4)
    assert plan.prefill_windows(windows) == 12
    old_windows = DistillRecipe(init="feature", prefill_text=("x",), minutes=60, generate_share=0.5, prefill_share=0.35)
    # the old plan: 300 tokens a second of 0.35 x 1,800 s, 512-token windows
    assert plan.prefill_windows(old_windows) == 370


def test_the_shipped_recipes_are_work_and_the_default_one_takes_about_twenty_minutes():
    from builder.distill import plan

    presets = [p for p in sorted((ROOT / "configs").glob("*.yaml")) if "distill" in yaml.safe_load(p.read_text())]
    assert len(presets) >= 4
    for path in presets:
        block = yaml.safe_load(path.read_text())["distill"]
        assert "minutes" not in block and block.get("train_steps"), path.name
    recipe = _preset_recipe("smollm2-135m.yaml")
    work, _ = plan.plan(recipe, 187, 21)  # the shipped corpus: 187 training prompts, 21 held out
    seconds = plan.expected_seconds(work, SMOLLM2, plan.draft_macs(recipe, SMOLLM2), features=True)
    assert 15 * 60 <= sum(seconds.values()) <= 25 * 60, seconds
    assert set(seconds) == {"setup", "heldout", "continuations", "training"}


class JumpingClock:
    """A clock that jumps ``step`` seconds every time it is read: a machine so slow (or busy) that any time budget
    is spent at once."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_each_stage_does_its_planned_work_however_slow_the_clock_says_it_runs(learnable_target, tmp_path, monkeypatch):
    """With a clock that jumps ten minutes at every reading, every stage still does exactly the work planned (the
    deprecated minutes of the recipe translated into steps, not a deadline); the plan and its expected time are
    said before the target loads, and the rates measured as the stages run."""
    import torch
    from rich.console import Console

    from builder.distill.pipeline import distill_draft
    from builder.distill.recipe import DistillRecipe

    torch.set_num_threads(1)
    target, prompts = learnable_target
    recipe = DistillRecipe(
        init="layers=1",
        prompts=prompts,
        max_new_tokens=6,
        continuations=37,
        samples_per_prompt=2,
        minutes=0.5,  # (30 s - 40% for data) x 0.9 x a step a second: 16 steps
        seed=0,
        heldout=0.2,
    )
    log = io.StringIO()
    console = Console(file=log, force_terminal=False, width=400)
    monkeypatch.setattr(time, "perf_counter", JumpingClock(600.0))
    report = distill_draft(recipe, str(target), tmp_path / "draft", console=console)
    assert report["train_prompts"] == 37 and report["training"]["steps"] == 16
    assert report["work"]["continuations"] == 37 and report["work"]["train_steps"] == 16
    lines = log.getvalue().splitlines()
    said = "\n".join(lines)
    plan_at = next(i for i, line in enumerate(lines) if line.startswith("distill: plan: "))
    assert "37 training continuations (up to 6 tokens each)" in lines[plan_at]
    assert "16 training steps of 1,024 token slots" in lines[plan_at]
    assert re.match(r"distill: expected about \d+ min on .*continuations \d+ s.*\); a busier", lines[plan_at + 1])
    assert plan_at < min(i for i, line in enumerate(lines) if line.startswith("teacher:"))
    assert "minutes (--minutes) is deprecated" in said
    assert re.search(r"the target made \d+ tokens/s on the held-out continuations", said)
    assert re.search(r"draft: training: [\d.]+ s a step measured over steps 2-11.*: the other 5 of 16 steps", said)
    assert re.search(r"training: step \d+, .*, step \d+/16, about \d+ s left", said)  # a line a minute, in a log


def test_a_stage_given_n_units_does_n_with_a_jumping_clock_in_the_engine_loops(learnable_target, tmp_path, monkeypatch):
    """The loops themselves: the engine's continuous batches make every job, the trainers take every step, with
    the clock jumping an hour at each reading."""
    import torch

    from builder import checkpoint as ckpt
    from builder.distill import feature_draft as fd
    from builder.distill import training
    from builder.distill.continuations import Job, generate_with_engine, target_engine
    from builder.distill.corpus import Sample

    checkpoint = ckpt.resolve(str(learnable_target[0]))
    engine = target_engine(checkpoint.load_model(), checkpoint, tmp_path, "fp32", 4, max_context=64, threads=1)
    monkeypatch.setattr(time, "perf_counter", JumpingClock(3600.0))
    made = generate_with_engine(engine, [Job([5, 6, 7], 1.0)] * 9, 5, top_k=2, eos_ids=[], batch_size=2)
    assert len(made) == 9
    torch.manual_seed(0)
    rng = __import__("numpy").random.default_rng(0)
    cfg = fd.FeatureConfig(
        hidden=16, heads=2, kv_heads=1, head_dim=8, intermediate=24, eps=1e-6, rope_theta=1e4, max_positions=64
    )
    draft = fd.module_from(cfg, {}, rng.standard_normal((40, 16)) * 0.1, rng.standard_normal((40, 16)))
    samples = [
        Sample([], rng.integers(0, 40, 12).tolist(), features=rng.standard_normal((11, 16)).astype("float16"))
        for _ in range(10)
    ]
    assert training.train_feature_draft(draft, samples, steps=13, tokens_per_batch=48)["steps"] == 13


@pytest.mark.parametrize("name", ["smollm2-135m.yaml", "qwen2.5-coder-1.5b-feature.yaml"])
def test_a_shipped_recipe_plans_the_same_work_everywhere(name):
    """The plan is a function of the recipe and the prompt count: nothing of the machine goes in."""
    from builder.distill import plan

    recipe = _preset_recipe(name)
    first, _ = plan.plan(recipe, 187, 48)
    assert first == plan.plan(recipe, 187, 48)[0]
    assert first.train_steps == recipe.train_steps and first.continuations >= 1
