"""Drafts for every registered architecture: the truncated self-draft and the feature draft read the target's config
(layer types, rotary settings, norm conventions) and keep greedy decoding exact; what a draft cannot follow is
refused before anything slow runs."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import EVAL_TOKENS, make_model, make_tokenizer, tiny_config

from builder.architectures import REGISTRY

PROMPTS = ["the quick brown fox", "def add(a, b):"]


def tiny_target(root, architecture: str, layers: int = 2):
    folder = root / architecture
    make_tokenizer(folder)
    make_model(folder, tiny_config(architecture, layers=layers), seed=3)
    return folder


def greedy_identity(bundle, k: int = 2) -> int:
    """Asserts speculative == target-only on PROMPTS; returns the accepted draft tokens."""
    from runtime.api import SpeculativeGenerator

    gen = SpeculativeGenerator.from_bundle(bundle, threads=1)
    accepted = 0
    for prompt in PROMPTS:
        spec = gen.generate(prompt, max_new_tokens=12, k=k)
        assert spec.token_ids == gen.generate(prompt, max_new_tokens=12, mode="target").token_ids
        accepted += spec.stats.num_accepted_tokens
    return accepted


LOADABLE = sorted(REGISTRY)  # Gemma 2 loads with eager attention (Architecture.attn_implementation)


@pytest.mark.parametrize("architecture", LOADABLE)
def test_truncated_self_draft_of_every_architecture(architecture, tmp_path):
    """``self:layers=1``: the first layer with its own layer type (Gemma: sliding) and rotary table."""
    from builder.build import build
    from runtime.bundle import BuildSpec

    target = tiny_target(tmp_path, architecture, layers=2)
    manifest = build(
        BuildSpec(
            target=str(target),
            draft="self:layers=1",
            target_quant="fp32",
            draft_quant="fp32",
            k=2,
            max_context=64,
            eval_tokens=EVAL_TOKENS,
        ),
        tmp_path / "bundle",
    )
    assert manifest.draft.num_layers == 1 and manifest.target.num_layers == 2
    assert max(manifest.report["export_check_max_abs_logit_diff"]["draft"].values()) < 1e-3
    greedy_identity(tmp_path / "bundle")


def test_truncated_config_keeps_the_first_layer_types():
    from transformers import AutoModelForCausalLM

    from builder.model_surgery import truncate

    model = AutoModelForCausalLM.from_config(tiny_config("Gemma3ForCausalLM", layers=2))
    draft = truncate(model, 1)
    assert draft.config.layer_types == ["sliding_attention"] and draft.config.num_hidden_layers == 1
    assert model.config.layer_types == ["sliding_attention", "full_attention"]  # the target is untouched


def test_feature_config_reads_per_layer_type_rotary_and_norm_conventions():
    """Gemma 3 keeps one rotary setting per layer type and scales its norms by (1 + w): the draft's one full-attention
    layer takes the full layers' base, and its final norm starts from the scale the target's norm really applies."""
    import torch
    from transformers import AutoModelForCausalLM

    from builder.distill import feature_draft as fd

    config = tiny_config("Gemma3ForCausalLM")
    assert fd.FeatureConfig.of_target(config).rope_theta == 1e6
    assert fd.FeatureConfig.of_target(tiny_config("LlamaForCausalLM", rope_theta=5e5)).rope_theta == 5e5
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.model.norm.weight.uniform_(-0.5, 0.5)
    draft = fd.init_feature_draft(model, None)
    assert torch.allclose(draft.final_norm, 1 + model.model.norm.weight, atol=1e-5)


@pytest.mark.parametrize("init", ["feature", "layers=1"])
def test_a_capped_output_is_refused_before_anything_slow(init, tmp_path):
    """Gemma 2 caps its logits (final_logit_softcapping): the trainers' softmax(head @ hidden) is not its law."""
    from builder.distill.corpus import DistillError
    from builder.distill.pipeline import distill_draft
    from builder.distill.recipe import DistillRecipe

    target = tmp_path / "gemma2"
    make_tokenizer(target)
    make_model(target, tiny_config("Gemma2ForCausalLM", final_logit_softcapping=30.0), seed=1)
    (tmp_path / "prompts.txt").write_text("one\ntwo\nthree\n", encoding="utf-8")
    with pytest.raises(DistillError, match="final_logit_softcapping 30.0"):
        distill_draft(
            DistillRecipe(init=init, prompts=tmp_path / "prompts.txt", train_steps=1),
            str(target),
            tmp_path / "d",
            quiet=True,
        )
    assert not (tmp_path / "d").exists()


def test_a_feature_draft_for_gemma3_builds_and_stays_exact(tmp_path):
    """Distilled on a tiny Gemma 3 (sliding and full layers, (1 + w) norms, scaled embedding, gelu): the draft is a
    Llama-style layer over the target's features, saved beside a one-layer Llama shell, and the bundle decodes
    exactly as the target does."""
    import json

    import torch

    from builder.build import build
    from builder.distill.pipeline import distill_draft
    from builder.distill.recipe import DistillRecipe
    from runtime.bundle import BuildSpec

    torch.set_num_threads(1)
    target = tiny_target(tmp_path, "Gemma3ForCausalLM")
    rng = np.random.default_rng(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "def", "add", "return", "print"]
    (tmp_path / "prompts.txt").write_text(
        "\n".join(" ".join(rng.choice(words, 5)) for _ in range(40)), encoding="utf-8"
    )
    recipe = DistillRecipe(
        init="feature",
        prompts=tmp_path / "prompts.txt",
        max_new_tokens=12,
        train_steps=30,
        seed=0,
        heldout=0.2,
        draft_vocab=100,
    )
    report = distill_draft(recipe, str(target), tmp_path / "draft", quiet=True)
    assert report["draft_kind"] == "feature"
    shell = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert shell["architectures"] == ["LlamaForCausalLM"] and shell["num_hidden_layers"] == 1
    manifest = build(
        BuildSpec(
            target=str(target),
            draft=str(tmp_path / "draft"),
            target_quant="fp32",
            draft_quant="fp32",
            k=2,
            max_context=64,
            eval_tokens=EVAL_TOKENS,
        ),
        tmp_path / "bundle",
    )
    assert manifest.target.architecture == "Gemma3ForCausalLM" and "features" in manifest.draft.input_names
    assert max(manifest.report["export_check_max_abs_logit_diff"]["draft"].values()) < 1e-3
    greedy_identity(tmp_path / "bundle")
