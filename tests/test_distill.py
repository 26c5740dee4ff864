"""draftsmith distill: distillation raises held-out acceptance on tiny models; the pieces it is made of."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest

from conftest import EVAL_TOKENS


@pytest.fixture(scope="module")
def distilled(learnable_target, tmp_path_factory):
    import torch
    from builder.distill.pipeline import distill_draft
    from builder.distill.recipe import DistillRecipe

    torch.set_num_threads(1)  # seeded and single-threaded: the same numbers every run
    target, prompts = learnable_target
    out = tmp_path_factory.mktemp("distilled") / "draft"
    recipe = DistillRecipe(
        init="layers=1",
        prompts=prompts,
        max_new_tokens=24,
        train_steps=250,
        seed=0,
        lr=3e-3,
        heldout=0.2,
        tokens_per_batch=512,
    )
    report = distill_draft(recipe, str(target), out, quiet=True)
    return out, report


def test_distillation_raises_heldout_acceptance(distilled):
    out, report = distilled
    before, after = report["before"], report["after"]
    assert report["heldout_prompts"] == 30 and report["heldout_tokens"] > 300
    # measured: top-1 0.16 -> 0.29, greedy acceptance at k=4 0.05 -> 0.10 (held-out prompts, never trained on)
    assert after["top1_agreement"] >= before["top1_agreement"] + 0.08
    assert after["greedy"]["4"]["acceptance"] >= before["greedy"]["4"]["acceptance"] + 0.03
    assert after["greedy"]["4"]["tokens_per_step"] > before["greedy"]["4"]["tokens_per_step"]


def test_distilled_draft_is_a_loadable_hf_folder(distilled):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, report = distilled
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert json.loads((out / "distill_report.json").read_text())["after"] == report["after"]
    assert not (out / "draft_vocab.json").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 1 and report["draft_layers"] == 1
    assert AutoTokenizer.from_pretrained(out).vocab_size == 320


def test_reduced_vocabulary_distillation_saves_the_kept_ids(learnable_target, tmp_path):
    from builder.distill.pipeline import distill_draft
    from builder.distill.recipe import DistillRecipe
    from builder.distill.save import read_draft_vocab

    target, prompts = learnable_target
    recipe = DistillRecipe(init="layers=1", prompts=prompts, max_new_tokens=8, train_steps=3, seed=0, draft_vocab=64)
    report = distill_draft(recipe, str(target), tmp_path / "d", quiet=True)
    kept = read_draft_vocab(tmp_path / "d")
    assert len(kept) == report["draft_vocab"] == 64 and list(kept) == sorted(kept)
    assert 2 in kept  # the EOS id is always kept
    assert 0.5 < report["draft_vocab_coverage_heldout"] <= 1.0


def test_replayed_greedy_acceptance_counts_like_the_loop():
    from builder.distill.evaluation import replay

    # matches of draft vs target along one continuation of 8 tokens
    m = np.array([1, 1, 0, 1, 1, 1, 1, 0], bool)
    # k=2: step1 drafts 2 (both accepted) +1 token -> pos 3; step2 drafts 2 ok -> pos 6; step3 drafts 1 (pos 6 ok)
    # -> pos 8. drafted 5, accepted 5.
    assert replay([m], 2)["acceptance"] == 1.0
    # k=4: drafts 4 at pos 0 (2 accepted, third wrong) -> pos 3; drafts 4 at pos 3 (all accepted) -> pos 8
    out = replay([m], 4)
    assert out["acceptance"] == round(6 / 8, 4) and out["tokens_per_step"] == 4.0
    assert out["alpha"] == [1.0, 1.0, 0.5, 1.0]
    assert replay([np.zeros(5, bool)], 3)["acceptance"] == 0.0


def test_kept_vocabulary_takes_the_most_frequent_tokens_and_eos():
    from builder.distill.corpus import Sample
    from builder.distill.draft import kept_vocabulary

    samples = [Sample([9, 9], [5, 5, 5, 3, 3, 7]), Sample([4], [5, 3, 1])]
    assert kept_vocabulary(samples, 2, 10, always=[]).tolist() == [3, 5]
    assert kept_vocabulary(samples, 3, 10, always=[2]).tolist() == [2, 3, 5]
    # unseen in continuations: prompt tokens come first, then the lowest ids
    assert kept_vocabulary(samples, 6, 10, always=[]).tolist() == [1, 3, 4, 5, 7, 9]


def test_prompt_file_blocks_and_completion_mark(tmp_path):
    from builder.distill.corpus import DistillError, load_prompts, split_prompts

    path = tmp_path / "p.txt"
    path.write_text("# comment\n---\n@completion\ndef f():\n---\nHello there\n---\nWhy?\n", encoding="utf-8")
    prompts = load_prompts(path)
    assert [(p.text, p.completion) for p in prompts] == [("def f():", True), ("Hello there", False), ("Why?", False)]
    train, held = split_prompts(prompts, 0.34, seed=0)
    assert len(held) == 1 and len(train) == 2 and {p.text for p in train + held} == {p.text for p in prompts}
    shipped = load_prompts()
    assert len(shipped) >= 150 and 40 <= sum(p.completion for p in shipped) < len(shipped) - 40
    path.write_text("only one\n", encoding="utf-8")
    with pytest.raises(DistillError):
        load_prompts(path)


def test_bad_init_is_refused(learnable_target, tmp_path):
    from builder.distill.corpus import DistillError
    from builder.distill.pipeline import distill_draft
    from builder.distill.recipe import DistillRecipe

    target, prompts = learnable_target
    with pytest.raises(DistillError, match="layers"):
        distill_draft(
            DistillRecipe(init="layers=2", prompts=prompts, max_new_tokens=2, train_steps=1),
            str(target),
            tmp_path / "d",
            quiet=True,
        )


def test_distill_command_is_registered():
    from click.testing import CliRunner
    from runtime.cli import main

    result = CliRunner().invoke(main, ["distill", "--help"])
    assert result.exit_code == 0
    for option in ("--target", "--init", "--out", "--prompts", "--minutes", "--draft-vocab", "--loss"):
        assert option in result.output


def test_extra_sampled_continuations_add_distinct_training_text(learnable_target, tmp_path):
    from builder.distill.corpus import DistillError
    from builder.distill.pipeline import distill_draft
    from builder.distill.recipe import DistillRecipe

    target, prompts = learnable_target
    recipe = DistillRecipe(init="layers=1", prompts=prompts, max_new_tokens=8, train_steps=1, seed=0)
    one = distill_draft(recipe, str(target), tmp_path / "one", quiet=True)
    three = distill_draft(
        dataclasses.replace(recipe, samples_per_prompt=3, sample_temperature=1.0),
        str(target),
        tmp_path / "three",
        quiet=True,
    )
    assert three["train_prompts"] == 3 * one["train_prompts"]
    assert three["train_tokens"] > 2 * one["train_tokens"]
    assert three["heldout_tokens"] == one["heldout_tokens"]  # held-out prompts stay greedy and unseen
    with pytest.raises(DistillError, match="samples-per-prompt"):
        distill_draft(
            DistillRecipe(init="layers=1", prompts=prompts, samples_per_prompt=0),
            str(target),
            tmp_path / "bad",
            quiet=True,
        )


def test_preset_recipe_distils_once_then_builds(learnable_target, tmp_path):
    """A preset's 'distill:' recipe: build-engines asks for the distillation first, `draftsmith distill --config`
    makes the draft into the preset's draft folder (once), and the build then takes it."""
    import yaml
    from click.testing import CliRunner

    from builder.cli import main as build_engines
    from runtime.bundle import load_manifest
    from runtime.cli import main as draftsmith

    target, prompts = learnable_target
    draft = tmp_path / "drafts" / "tiny-l1"
    preset = tmp_path / "preset.yaml"
    preset.write_text(
        yaml.safe_dump(
            {
                "target": str(target),
                "draft": str(draft),
                "target_quant": "fp32",
                "draft_quant": "fp32",
                "k": 2,
                "max_context": 128,
                "eval_tokens": EVAL_TOKENS,
                "distill": {
                    "init": "layers=1",
                    "minutes": 1.0,
                    "max_new_tokens": 8,
                    "generate_share": 0.2,
                    "prompts": str(prompts),
                    "lr": 1e-3,
                },
            }
        )
    )
    runner = CliRunner()
    refused = runner.invoke(build_engines, ["--config", str(preset), "--out", str(tmp_path / "b")])
    assert refused.exit_code == 2 and f"draftsmith distill --config {preset}" in refused.output
    made = runner.invoke(draftsmith, ["distill", "--config", str(preset), "--json", "--max-new-tokens", "6"])
    assert made.exit_code == 0, made.output
    report = json.loads((draft / "distill_report.json").read_text())
    assert report["init"] == "layers=1" and report["minutes"] == 1.0 and report["generate_share"] == 0.2
    # the deprecated minutes as work: (60 s - 20% for data) x 0.9 x 1 step a second
    assert report["work"]["train_steps"] == report["training"]["steps"] == 43
    assert report["max_new_tokens"] == 6  # a flag overrides the recipe
    stamp = (draft / "distill_report.json").stat().st_mtime_ns
    again = runner.invoke(draftsmith, ["distill", "--config", str(preset)])
    assert again.exit_code == 0 and "already holds" in again.output
    assert (draft / "distill_report.json").stat().st_mtime_ns == stamp
    built = runner.invoke(build_engines, ["--config", str(preset), "--out", str(tmp_path / "b"), "--json"])
    assert built.exit_code == 0, built.output
    manifest = load_manifest(tmp_path / "b")
    assert manifest.draft.source == str(draft) and manifest.draft.num_layers == 1


def test_the_commands_flags_are_the_recipes_keys_with_its_defaults():
    """The command builds its recipe from its flags and overrides a preset's recipe with the flags given: both hold
    only if the flags are RECIPE_KEYS and each flag's default is the recipe field's."""
    from builder.distill.cli import distill
    from builder.distill.recipe import RECIPE_KEYS, DistillRecipe

    fields = {f.name: f.default for f in dataclasses.fields(DistillRecipe)}
    flags = {p.name: p.default for p in distill.params}
    assert set(RECIPE_KEYS) <= set(fields)
    assert set(RECIPE_KEYS) == set(flags) - {"config_path", "target", "out", "threads", "work", "force", "as_json"}
    assert {key: flags[key] for key in RECIPE_KEYS} == {key: fields[key] for key in RECIPE_KEYS}


def test_a_preset_builds_a_recipe_and_flags_override_it():
    from builder.distill.corpus import DistillError
    from builder.distill.recipe import DistillRecipe, recipe_from

    target, out, recipe = recipe_from(
        {"target": "t", "draft": "d", "distill": {"init": "feature", "minutes": 20, "draft_vocab": 8192}}, "p.yaml"
    )
    assert (target, out) == ("t", "d")
    assert recipe == DistillRecipe(init="feature", minutes=20, draft_vocab=8192)
    assert recipe.overridden({"minutes": 5, "top_k": 3}) == DistillRecipe(
        init="feature", minutes=5, draft_vocab=8192
    )  # RECIPE_KEYS only
    for bad, match in (
        (dict(draft_vocab=-1), "draft-vocab"),
        (dict(samples_per_prompt=0), "samples-per-prompt"),
        (dict(teacher_engine="tpu"), "teacher-engine"),
        (dict(init="feature", teacher_engine="torch"), "hidden states"),
        (dict(self_prompts=-1), "self-prompts"),
        (dict(generate_batch=0), "generate-batch"),
        (dict(generate_share=1.0), "generate-share"),
        (dict(gguf_kernel="cuda"), "gguf_kernel"),
    ):
        with pytest.raises(DistillError, match=match):
            DistillRecipe(**bad).check()
    DistillRecipe().check()


def test_the_teacher_engine_takes_the_presets_gguf_kernel():
    """The distiller's teacher multiplies with the kernel the bundle's target engine will: the preset's top-level
    ``gguf_kernel``, resolved by the rule build-engines uses."""
    from builder.quantize import native_gguf
    from builder.distill.recipe import recipe_from
    from runtime.bundle import BuildSpec
    from runtime.engines import gguf_ops

    preset = {"target": "t", "draft": "d", "distill": {"init": "feature"}}
    assert recipe_from(preset, "p.yaml")[2].gguf_kernel == "auto"
    for kernel in ("auto", "native", "matmulnbits"):
        recipe = recipe_from({**preset, "gguf_kernel": kernel}, "p.yaml")[2]
        assert recipe.gguf_kernel == kernel
        assert gguf_ops.native_for(kernel) == native_gguf(BuildSpec(target="t", gguf_kernel=kernel, graph="fused"))
    assert gguf_ops.native_for("native") and not gguf_ops.native_for("matmulnbits")
    assert gguf_ops.native_for("auto") == gguf_ops.available()


def test_recipe_errors_name_the_problem(tmp_path):
    from builder.distill.recipe import recipe_from
    from builder.distill.corpus import DistillError

    with pytest.raises(DistillError, match="no 'distill:' recipe"):
        recipe_from({"target": "t", "draft": "d"}, "p.yaml")
    with pytest.raises(DistillError, match=r"unknown distill option\(s\) \['epochs'\]"):
        recipe_from({"target": "t", "draft": "d", "distill": {"epochs": 3}}, "p.yaml")
    with pytest.raises(DistillError, match="must name the target"):
        recipe_from({"target": "t", "distill": {}}, "p.yaml")


def _engine_and_model(learnable_target, tmp_path):
    from builder import checkpoint as ckpt
    from builder.distill.continuations import target_engine

    checkpoint = ckpt.resolve(str(learnable_target[0]))
    model = checkpoint.load_model()
    return target_engine(model, checkpoint, tmp_path, "fp32", 4, max_context=96, threads=1), model


def test_engine_continuations_and_teacher_rows_match_torch(learnable_target, tmp_path):
    """The ONNX engine's continuous batches (rows joining and leaving) give torch's greedy continuations and the
    teacher rows torch's teacher-forced pass gives, at every position, prompt positions included."""
    import copy

    from builder.distill.continuations import Job, generate, generate_with_engine
    from builder.distill.distributions import teacher

    engine, model = _engine_and_model(learnable_target, tmp_path)
    assert engine is not None
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 300) for _ in range(rng.randint(2, 12))] for _ in range(11)]
    made = generate_with_engine(engine, [Job(p) for p in prompts], 10, top_k=8, eos_ids=[2], batch_size=4)
    reference = generate(model, prompts, 10, eos_ids=[2], pad_id=0, batch_size=1)
    assert [s.continuation for s in made] == [s.continuation for s in reference]
    forced = copy.deepcopy(reference)
    teacher(model, forced, 8)
    for ours, theirs in zip(made, forced):
        assert ours.top_probs.shape == (len(ours.ids) - 1, 8) and ours.rows_from == 0
        np.testing.assert_allclose(ours.top_probs, theirs.top_probs, atol=1e-4)
        assert (ours.top_ids[:, 0] == theirs.top_ids[:, 0]).all()
    # a further sample of a prompt: the same continuation, rows for the continuation only
    tails = generate_with_engine(
        engine, [Job(p, prompt_rows=False) for p in prompts], 10, top_k=8, eos_ids=[2], batch_size=4
    )
    for tail, full in zip(tails, made):
        assert tail.continuation == full.continuation and tail.rows_from == len(tail.prompt) - 1
        np.testing.assert_allclose(tail.top_probs, full.top_probs[tail.rows_from :], atol=1e-5)


def test_engine_sampled_continuations_are_seeded_by_job_whatever_shares_their_batch(learnable_target, tmp_path):
    """Each job draws from its own seed (the run's and its number): the same continuation whatever batch size, rows
    beside it or part of the plan it runs in (a resumed run makes the jobs a killed one lost, as it would have)."""
    import dataclasses

    from builder.distill.continuations import Job, generate_with_engine

    engine, _ = _engine_and_model(learnable_target, tmp_path)
    jobs = [Job([5, 6, 7], 1.0)] * 6
    one = generate_with_engine(engine, jobs, 12, top_k=4, eos_ids=[], seed=1, batch_size=3)
    again = generate_with_engine(engine, jobs, 12, top_k=4, eos_ids=[], seed=1, batch_size=3)
    other = generate_with_engine(engine, jobs, 12, top_k=4, eos_ids=[], seed=2, batch_size=3)
    assert [s.continuation for s in one] == [s.continuation for s in again]
    assert [s.continuation for s in one] != [s.continuation for s in other]
    assert len({tuple(s.continuation) for s in one}) > 1 and all(len(s.continuation) == 12 for s in one)
    wide = generate_with_engine(engine, jobs, 12, top_k=4, eos_ids=[], seed=1, batch_size=6)
    assert [s.continuation for s in wide] == [s.continuation for s in one]
    rest = [dataclasses.replace(jobs[i], number=i) for i in (4, 1, 5)]  # what a resumed run has left, numbered
    resumed = generate_with_engine(engine, rest, 12, top_k=4, eos_ids=[], seed=1, batch_size=2)
    assert [s.continuation for s in resumed] == [one[i].continuation for i in (4, 1, 5)]


def test_user_turn_prefix_is_the_template_up_to_the_users_message(learnable_target):
    from transformers import AutoTokenizer

    from builder.distill.self_prompts import user_turn_prefix

    tokenizer = AutoTokenizer.from_pretrained(learnable_target[0])
    prefix = user_turn_prefix(tokenizer)
    assert tokenizer.decode(prefix) == "<|im_start|>user\n"
    tokenizer.chat_template = None  # a base model: no user turn to complete
    assert user_turn_prefix(tokenizer) is None


def test_self_prompts_keep_finished_distinct_queries_only(learnable_target, tmp_path, monkeypatch):
    """The target's own queries (Magpie): sampled from the user-turn prefix by the engine; a query cut off at the
    token limit, one under three words, and one already known (in any case or spacing) are dropped."""
    from transformers import AutoTokenizer

    from builder.distill import self_prompts as sp
    from builder.distill.corpus import Prompt, Sample

    tokenizer = AutoTokenizer.from_pretrained(learnable_target[0])
    engine, _ = _engine_and_model(learnable_target, tmp_path)
    real = sp.generate_with_engine(
        engine,
        [sp.Job(sp.user_turn_prefix(tokenizer), 1.0, prompt_rows=False)] * 3,
        6,
        top_k=1,
        eos_ids=[2],
        seed=0,
        batch_size=2,
    )
    assert len(real) == 3 and all(s.prompt == sp.user_turn_prefix(tokenizer) for s in real)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    texts = [
        "def add(a, b): return a + b",
        "the quick brown",
        "The  QUICK brown",
        "lazy dog",
        "Lazy dog jumps",
        "for i in range(10): print(i)",
        "def add(a, b): return a + b",
    ]
    finished = [True, True, True, True, True, False, True]
    made = [
        Sample([1], tokenizer(t, add_special_tokens=False)["input_ids"] + ([end] if f else []))
        for t, f in zip(texts, finished)
    ]
    asked = {}

    def fake_generate(engine, jobs, max_tokens, **kw):
        asked.update(jobs=len(jobs), prefix=jobs[0].prompt, eos=kw["eos_ids"])
        return made

    monkeypatch.setattr(sp, "generate_with_engine", fake_generate)
    kept = sp.self_prompts(engine, tokenizer, 7, eos_ids=[end], seed=0, known=[Prompt("lazy  DOG jumps")])
    assert [p.text for p in kept] == ["def add(a, b): return a + b", "the quick brown"]
    assert asked == {"jobs": 7, "prefix": sp.user_turn_prefix(tokenizer), "eos": [end]}
    tokenizer.chat_template = None
    assert sp.self_prompts(engine, tokenizer, 6, eos_ids=[end], seed=0, known=[]) == []
