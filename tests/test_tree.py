"""bench/tree.py: the measurements behind "does tree verification pay here" (tree-headroom)."""

from __future__ import annotations

import json

import pytest

from bench.sweep import decode
from bench.tree import coverage, depth1_tree, tree_attention, verify_cost


def test_a_depth1_tree_is_priced_by_its_rows():
    costs = {2: 10.0, 3: 12.0, 4: 14.0}
    rows = depth1_tree(costs, [0.5, 0.6, 0.7, 0.75], draft_ms=1.0)
    assert [r["candidates"] for r in rows] == [1, 2, 3]
    assert rows[0]["speedup"] == pytest.approx(1.5 / 1.1, abs=1e-3)  # the chain of one: 2 rows and a draft call
    assert rows[1]["speedup"] == pytest.approx(1.6 / 1.3, abs=1e-3)  # one more row costs more than it accepts
    assert rows[2]["tokens_per_step"] == 1.7


@pytest.mark.parametrize("bundle", ["tiny_bundle", "tiny_int4_bundle"])
def test_tree_attention_keeps_the_main_chain_exact(bundle, request):
    from runtime.bundle import load_manifest

    root = request.getfixturevalue(bundle)
    found = tree_attention(root, load_manifest(root), threads=1, trials=2)
    assert found["main_chain_max_abs_diff"] == 0.0  # laid out first, the main chain is the chain verify, bit for bit
    assert found["off_chain_rows"] == 6
    if bundle == "tiny_bundle":  # fp32: off-chain nodes only differ by summation order
        assert found["off_chain_max_abs_diff"] < 1e-3


def test_coverage_top1_is_the_greedy_acceptance_at_k1(generator):
    ids = [generator.encode_prompt(p, False) for p in ("def add(a, b):\n    return", "The quick brown fox")]
    found = coverage(generator, ids, 24)
    hits = found["hit_top_1_to_4"]
    assert found["steps"] > 0 and hits == sorted(hits) and found["draft_call_ms"] > 0
    records = [decode(generator, [i], "speculative", 1, 24, 0.0, 0, "model", 0.0, plan=False)[0][0] for i in ids]
    steps = [step for record in records for step in record.steps]
    drafted, accepted = sum(s[0] for s in steps), sum(s[1] for s in steps)
    assert drafted == found["steps"] and hits[0] == round(accepted / drafted, 3)
    assert generator.draft.__class__.__name__ != "_TopRecorder"  # the engine is given back


def test_verify_cost_and_the_command(tiny_bundle, tmp_path):
    from click.testing import CliRunner

    from runtime.api import SpeculativeGenerator
    from runtime.cli import main

    costs = verify_cost(SpeculativeGenerator.from_bundle(tiny_bundle, threads=1).target, calls=3)
    assert sorted(costs) == [2, 3, 4, 5, 6, 8] and min(costs.values()) > 0
    out = tmp_path / "tree.json"
    result = CliRunner().invoke(
        main,
        [
            "tree-headroom",
            str(tiny_bundle),
            "--workload",
            "code",
            "--prompts",
            "1",
            "--max-new-tokens",
            "8",
            "--threads",
            "1",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert set(report) == {"verify_cost_ms", "verify_cost_relative", "workloads", "tree_attention"}
    assert report["workloads"]["code"]["depth1_tree"][0]["candidates"] == 1
