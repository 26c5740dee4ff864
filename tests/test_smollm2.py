"""The default preset on the real SmolLM2-135M-Instruct (slow: builds the bundle once, ~3-4 minutes; runs in CI)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.api import SpeculativeGenerator
from runtime.bundle import load_manifest

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Explain why the sky is blue in one sentence."]


@pytest.fixture(scope="module")
def smollm2(smollm2_bundle):
    return SpeculativeGenerator.from_bundle(smollm2_bundle, threads=2)


def test_default_bundle_manifest(smollm2_bundle):
    manifest = load_manifest(smollm2_bundle)
    assert manifest.spec.target_quant == "fp32" and manifest.spec.draft_quant == "int4"
    assert manifest.target.architecture == "LlamaForCausalLM" and manifest.target.num_layers == 30
    assert manifest.target.vocab_size == 49152
    checks = manifest.report["export_check_max_abs_logit_diff"]["target"]
    assert max(checks.values()) < 1e-2  # the graph agreed with transformers at build time
    assert 0.5 < manifest.report["draft"]["top1_agreement_vs_fp32"] < 1.0  # int4 costs something, not everything


def test_each_engine_runs_a_forward_pass(smollm2):
    ids = smollm2.tokenizer.encode("Hello, world")
    for engine in (smollm2.target, smollm2.draft):
        cache = engine.new_cache(1)
        logits = engine.forward(cache, np.array([ids]))
        assert logits.shape == (1, len(ids), 49152) and np.isfinite(logits).all()
        assert int(cache.lengths[0]) == len(ids)


def test_greedy_speculative_equals_target_only(smollm2):
    for prompt in PROMPTS:
        spec = smollm2.generate(prompt, max_new_tokens=24, k=3, plan=False)
        plain = smollm2.generate(prompt, max_new_tokens=24, mode="target")
        assert spec.token_ids == plain.token_ids
        assert spec.stats.num_accepted_tokens > 0


def test_batched_chat_equals_single(smollm2):
    batch = smollm2.generate(PROMPTS[1:], max_new_tokens=16, chat=True)
    for prompt, result in zip(PROMPTS[1:], batch):
        assert result.token_ids == smollm2.generate(prompt, max_new_tokens=16, chat=True, mode="target").token_ids


def test_answers_are_sensible(smollm2):
    """A real model, really loaded: the obvious answer comes out."""
    assert "Paris" in smollm2.generate("What is the capital of France?", max_new_tokens=20, chat=True).text
