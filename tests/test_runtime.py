"""The runtime over real (tiny) ONNX engines, and the loop's control flow over scripted engines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fakes import BigramEngine, random_table
from runtime.api import SpeculativeGenerator
from runtime.errors import RequestError
from runtime.decoding.config import AdaptiveK, DecodeConfig, Fallback
from batch_run import BatchRun
from runtime.drafters.model import ModelDrafter

PROMPTS = ["The quick brown", "def add(a, b):\n    return", "x", "Speculative decoding keeps the target's output"]


def run_loop(target, draft, prompts, **config):
    loop = BatchRun(target, ModelDrafter(draft) if draft else None, prompts, DecodeConfig(**config))
    steps = list(loop.run())
    return loop, steps


# --- greedy equivalence on real engines -------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_speculative_equals_target_only(generator, k):
    for prompt in PROMPTS[:2]:
        spec = generator.generate(prompt, max_new_tokens=40, k=k)
        plain = generator.generate(prompt, max_new_tokens=40, mode="target")
        assert spec.token_ids == plain.token_ids
        assert spec.text == plain.text
        assert spec.stats.num_steps < plain.stats.num_steps or spec.stats.num_accepted_tokens == 0


def test_the_pair_accepts_some_and_rejects_some(generator):
    """Otherwise the equivalence tests above would not exercise rollback."""
    stats = generator.generate(PROMPTS[0], max_new_tokens=60, k=4, plan=False).stats  # drafts every step
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("k", [1, 3])
def test_batch_equals_each_prompt_alone(generator, k):
    batch = generator.generate(PROMPTS, max_new_tokens=30, k=k)
    for prompt, result in zip(PROMPTS, batch):
        alone = generator.generate(prompt, max_new_tokens=30, mode="target")
        assert result.token_ids == alone.token_ids


def test_batch_rows_finish_at_different_times(generator):
    free = generator.generate(PROMPTS[1], max_new_tokens=30, mode="target").text
    stop = free[5:8]
    batch = generator.generate([PROMPTS[0], PROMPTS[1]], max_new_tokens=30, stop=[stop])
    assert batch[1].finish_reason == "stop" and len(batch[1].text) <= 5 + len(stop)
    assert batch[0].token_ids == generator.generate(PROMPTS[0], max_new_tokens=30, stop=[stop]).token_ids


def test_rollback_continuation_equals_fresh_run_from_accepted_prefix(generator):
    """Generation that continued after rejections equals a fresh run started from the accepted prefix."""
    tok = generator.tokenizer
    first = generator.generate(PROMPTS[0], max_new_tokens=40, k=4, plan=False)  # drafts every step
    assert first.stats.num_draft_tokens > first.stats.num_accepted_tokens  # rejections happened
    prompt_ids = tok.encode(PROMPTS[0])
    prefix = prompt_ids + first.token_ids[:20]
    loop = BatchRun(generator.target, ModelDrafter(generator.draft), [prefix], DecodeConfig(max_new_tokens=20, k=4))
    for _ in loop.run():
        pass
    assert loop.rows[0].generated == first.token_ids[20:40]


def test_sampled_generation_is_reproducible_with_a_seed(generator):
    a = generator.generate(PROMPTS[0], max_new_tokens=30, temperature=0.9, top_p=0.95, seed=3)
    b = generator.generate(PROMPTS[0], max_new_tokens=30, temperature=0.9, top_p=0.95, seed=3)
    c = generator.generate(PROMPTS[0], max_new_tokens=30, temperature=0.9, top_p=0.95, seed=4)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_seeded_requests_batched_together_sample_as_alone(generator):
    """One seed per prompt: two identical seeded requests in one batch (with another between them) each give what
    they give alone."""
    options = dict(max_new_tokens=30, temperature=0.9, top_p=0.95)
    alone = generator.generate(PROMPTS[0], seed=3, **options)
    batch = generator.generate([PROMPTS[0], PROMPTS[1], PROMPTS[0]], seed=[3, 4, 3], **options)
    assert batch[0].token_ids == batch[2].token_ids == alone.token_ids
    assert batch[1].token_ids == generator.generate(PROMPTS[1], seed=4, **options).token_ids
    assert generator.generate(PROMPTS[0], seed=5, **options).token_ids != alone.token_ids


def test_cancelled_sequence_leaves_the_batch_at_once(generator):
    """``stream_batch(cancelled=...)``: a cancelled row finishes at the next step ("cancelled") and leaves the batch;
    the other row's tokens are those it gets alone."""
    steps = {0: 0}

    def cancelled(index):
        if index == 0:
            steps[0] += 1
        return index == 0 and steps[0] >= 2

    done = {}
    for index, _, generation in generator.stream_batch(
        [PROMPTS[1], PROMPTS[0]], cancelled=cancelled, max_new_tokens=40, mode="target"
    ):
        if generation is not None:
            done[index] = generation
    assert done[0].finish_reason == "cancelled" and done[0].stats.num_steps == 2 and len(done[0].token_ids) == 2
    assert steps[0] == 2  # never asked again: the row left the batch
    alone = generator.generate(PROMPTS[0], max_new_tokens=40, mode="target")
    assert done[1].token_ids == alone.token_ids and done[1].finish_reason == alone.finish_reason


# --- streaming and text -----------------------------------------------------------------------------------------


def test_stream_concatenation_equals_generate(generator):
    for prompt in PROMPTS:
        pieces = list(generator.stream(prompt, max_new_tokens=40, k=3))
        assert "".join(pieces) == generator.generate(prompt, max_new_tokens=40, k=3).text


def test_stream_never_splits_a_multibyte_character(generator):
    """Byte-level tokens can carry half a character; no streamed piece may end inside one."""
    tok = generator.tokenizer
    ids = tok.encode("日本語のテキスト 🙂🚀 café")
    from runtime.text.tokenizer import IncrementalDecoder

    decoder = IncrementalDecoder(tok)
    pieces = [decoder.push([i]) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p) < len(ids)  # some tokens were held back: they were partial characters


def test_stop_string_split_across_tokens(generator):
    full = generator.generate(PROMPTS[1], max_new_tokens=40).text
    stop = full[10:14]
    result = generator.generate(PROMPTS[1], max_new_tokens=40, stop=stop)
    assert result.finish_reason == "stop"
    assert result.text == full[: full.find(stop)]
    assert "".join(generator.stream(PROMPTS[1], max_new_tokens=40, stop=stop)) == result.text


def test_eos_ends_generation():
    table = np.full((5, 5), -5.0)
    table[:, 4] = 5.0  # every token is followed by token 4 (our EOS)
    target = BigramEngine(table)
    loop, _ = run_loop(target, BigramEngine(table), [[1, 2]], max_new_tokens=10, k=3, eos_ids=(4,))
    assert loop.rows[0].generated == [4] and loop.rows[0].finished == "stop"


def test_context_limit_ends_cleanly():
    table = random_table(6, 0)
    target = BigramEngine(table, max_context=12)
    loop, _ = run_loop(target, BigramEngine(table, max_context=12), [[1] * 5], max_new_tokens=50, k=4)
    row = loop.rows[0]
    assert row.finished == "context" and row.total == 12


def test_chat_template_is_applied(generator):
    rendered = generator.tokenizer.apply_chat_template("hello")
    assert rendered.startswith("<|im_start|>user\nhello<|im_end|>") and rendered.endswith("assistant\n")
    chat = generator.generate("hello", max_new_tokens=5, chat=True)
    assert chat.prompt_tokens == len(generator.tokenizer.encode(rendered))


# --- control flow over scripted engines -------------------------------------------------------------------------


def test_call_counts_with_a_perfect_draft():
    """A draft identical to the target: every step accepts k and adds a bonus; draft calls are k per step."""
    table = random_table(7, 1)
    target, draft = BigramEngine(table), BigramEngine(table)
    loop, steps = run_loop(target, draft, [[0, 1]], max_new_tokens=21, k=4)
    row = loop.rows[0]
    assert len(row.generated) == 21
    assert row.stats.num_steps == 5  # 4 full steps emit 5 each (20), then one token left: k shrinks to 0
    assert row.stats.num_accepted_tokens == 16 and row.stats.draft_acceptance_rate == 1.0
    assert target.calls == 1 + 5  # prefill + one verify per step
    assert draft.calls == 4 * 4  # k calls per drafting step, nothing in the last step
    assert row.stats.mean_acceptance_length == 5.0


def test_a_useless_draft_still_gives_target_output():
    target_table, draft_table = random_table(7, 1), -random_table(7, 1)  # the draft prefers what the target doesn't
    spec, _ = run_loop(BigramEngine(target_table), BigramEngine(draft_table), [[0, 1]], max_new_tokens=30, k=3)
    plain, _ = run_loop(BigramEngine(target_table), None, [[0, 1]], max_new_tokens=30, k=3)
    assert spec.rows[0].generated == plain.rows[0].generated
    assert spec.rows[0].stats.draft_acceptance_rate < 0.2


def test_draft_cache_matches_emitted_tokens_after_every_step():
    """Rollback keeps exactly the accepted prefix in both caches (the invariant the loop relies on)."""
    target_table = random_table(6, 3)
    draft_table = target_table + np.random.default_rng(4).normal(0, 1.0, target_table.shape)
    target, draft = BigramEngine(target_table), BigramEngine(draft_table)
    drafter = ModelDrafter(draft)
    loop = BatchRun(target, drafter, [[0, 1, 2]], DecodeConfig(max_new_tokens=40, k=3))
    for _ in loop.run():
        row = loop.rows[0]
        seen = draft.live_tokens(drafter.cache, 0) + drafter.pending[0]
        assert seen == row.prompt + row.generated
    assert 0 < loop.rows[0].stats.num_accepted_tokens < loop.rows[0].stats.num_draft_tokens


def test_adaptive_k_grows_on_full_acceptance_and_shrinks_on_rejection():
    table = random_table(7, 1)
    loop = BatchRun(
        BigramEngine(table),
        ModelDrafter(BigramEngine(table)),
        [[0]],
        DecodeConfig(max_new_tokens=60, k=1, adaptive=AdaptiveK(min_k=1, max_k=6)),
    )
    ks = []
    for _ in loop.run():
        ks.append(loop.k)
    assert ks[:3] == [3, 5, 6]
    bad = BatchRun(
        BigramEngine(table),
        ModelDrafter(BigramEngine(-table)),
        [[0]],
        DecodeConfig(max_new_tokens=30, k=5, adaptive=AdaptiveK(min_k=1, max_k=6)),
    )
    for _ in bad.run():
        pass
    assert bad.k == 1


def test_fallback_switches_to_target_only_and_reprobes():
    table = random_table(7, 1)
    draft = BigramEngine(-table)
    loop = BatchRun(
        BigramEngine(table),
        ModelDrafter(draft),
        [[0]],
        DecodeConfig(max_new_tokens=120, k=4, fallback=Fallback(threshold=0.5, window=8, probe_every=10)),
    )
    states = []
    loop.on_fallback = states.append
    plain, _ = run_loop(BigramEngine(table), None, [[0]], max_new_tokens=120, k=4)
    for _ in loop.run():
        pass
    stats = loop.rows[0].stats
    assert states[:3] == [True, False, True]  # fell back, re-probed, fell back again
    assert stats.fallback_steps >= 10
    assert loop.rows[0].generated == plain.rows[0].generated


def test_draft_confidence_stops_drafting_early():
    table = random_table(7, 1, scale=0.01)  # a nearly uniform draft: never confident
    target = BigramEngine(random_table(7, 2))
    drafter = ModelDrafter(BigramEngine(table), confidence=0.5)
    loop = BatchRun(target, drafter, [[0]], DecodeConfig(max_new_tokens=10, k=4))
    for _ in loop.run():
        pass
    assert loop.rows[0].stats.num_draft_tokens == loop.rows[0].stats.num_drafts  # one token per step, not 4


# --- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(k=0), "k: expected greater than or equal to 1"),
        (dict(k=99), "k: expected an integer in"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.1), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(mode="fast"), "mode"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_requests_are_clear_errors(generator, kwargs, message):
    with pytest.raises(RequestError, match=message):
        generator.generate("hello", **kwargs)


def test_empty_and_overlong_prompts(generator):
    with pytest.raises(RequestError, match="non-empty"):
        generator.generate("")
    with pytest.raises(RequestError, match="context"):
        generator.generate("word " * 400)


def test_tampered_bundle_is_refused(tiny_bundle, tmp_path):
    import shutil
    from runtime.bundle import BundleError

    copy = tmp_path / "copy"
    shutil.copytree(tiny_bundle, copy)
    engine = copy / "draft" / "model.onnx"
    data = bytearray(engine.read_bytes())
    data[len(data) // 2] ^= 0x01
    engine.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="draft/model.onnx: sha256 differs"):
        SpeculativeGenerator.from_bundle(copy)


# --- metrics ----------------------------------------------------------------------------------------------------


def test_metrics_definitions_and_prometheus_export():
    table = random_table(7, 1)
    gen = SpeculativeGenerator(None, BigramEngine(table), BigramEngine(table), tokenizer=_IdTokenizer(), eos_ids=())
    result = gen.generate("ab", max_new_tokens=11, k=4, plan=False)  # k every step: the definitions' counts
    s = result.stats
    assert s.num_emitted_tokens == 11
    assert s.draft_acceptance_rate == s.num_accepted_tokens / s.num_draft_tokens == 1.0
    assert s.mean_acceptance_length == 1 + s.num_accepted_tokens / s.num_drafts
    assert s.system_efficiency == pytest.approx(11 / s.verify_slots)
    assert s.acceptance_per_position[:4] == [1.0, 1.0, 1.0, 1.0]
    from prometheus_client.parser import text_string_to_metric_families

    text = gen.metrics_text()
    samples = {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for family in text_string_to_metric_families(text)
        for x in family.samples
    }
    assert samples[("draftsmith_accepted_tokens_total", ())] == s.num_accepted_tokens
    assert samples[("draftsmith_requests_total", ())] == 1
    assert samples[("draftsmith_acceptance_by_position", (("position", "1"),))] == 1.0
    # vLLM's spec-decode counters carry the same counts under vLLM's names
    assert samples[("vllm:spec_decode_num_drafts_total", ())] == s.num_drafts
    assert samples[("vllm:spec_decode_num_draft_tokens_total", ())] == s.num_draft_tokens
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", ())] == s.num_accepted_tokens
    assert samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),))] == s.num_drafts
    # one request: one TTFT and one inter-token latency observation, (total - TTFT) / (tokens - 1)
    assert samples[("draftsmith_time_to_first_token_seconds_count", ())] == 1
    assert samples[("draftsmith_time_to_first_token_seconds_sum", ())] == pytest.approx(s.time_to_first_token)
    assert samples[("draftsmith_inter_token_latency_seconds_count", ())] == 1
    assert samples[("draftsmith_inter_token_latency_seconds_sum", ())] == pytest.approx(
        (s.total_time - s.time_to_first_token) / (s.num_emitted_tokens - 1)
    )


def test_metrics_registries_count_apart():
    """Each bundle has its own MetricsRegistry: two generators in one process never share counts (nor clash on
    names)."""
    from runtime.metric_families import prometheus_text, read
    from runtime.metrics import MetricsRegistry, RequestStats

    one, two = MetricsRegistry(), MetricsRegistry()
    one.add(RequestStats(num_emitted_tokens=1, time_to_first_token=0.2, total_time=0.2))

    def text(registry):
        return prometheus_text(read(registry))

    assert "draftsmith_requests_total 1.0" in text(one)
    assert "draftsmith_requests_total 0.0" in text(two)
    assert 'draftsmith_time_to_first_token_seconds_bucket{le="0.25"} 1.0' in text(one)
    assert 'draftsmith_time_to_first_token_seconds_bucket{le="0.1"} 0.0' in text(one)
    assert "draftsmith_inter_token_latency_seconds_count 0.0" in text(one)  # one token: no inter-token gap
    one.fallback_active = True
    assert "draftsmith_fallback_active 1.0" in text(one)


def test_decoding_never_imports_prometheus_client():
    """Triton's Python backend runs the runtime but cannot import prometheus_client (its ssl import fails in the
    stub's interpreter): only an export imports it."""
    code = (
        "import sys\nfrom runtime.metrics import MetricsRegistry, RequestStats\nimport runtime.api\n"
        "from runtime.metric_families import TritonMetrics, prometheus_text, read\n"
        "m = MetricsRegistry()\nm.add(RequestStats(num_emitted_tokens=3, total_time=1.0))\n"
        "assert 'prometheus_client' not in sys.modules\nprometheus_text(read(m))\n"
        "assert 'prometheus_client' in sys.modules\n"
    )
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})


class _IdTokenizer:
    """Characters 'a'.. map to ids 0..; enough for the metrics test over a bigram engine."""

    vocab_size = 7

    def encode(self, text):
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)

    def apply_chat_template(self, prompt):
        return prompt


# --- the command line ---------------------------------------------------------------------------------------------


def test_generate_command_json(tiny_bundle):
    import json
    from click.testing import CliRunner
    from runtime.cli import main

    result = CliRunner().invoke(
        main,
        [
            "generate",
            str(tiny_bundle),
            "The quick brown",
            "--max-new-tokens",
            "20",
            "--k",
            "3",
            "--threads",
            "1",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["identical_to_target"] is True
    assert report["speculative"]["num_emitted_tokens"] == 20 == len(report["token_ids"])
    assert 0 <= report["speculative"]["draft_acceptance_rate"] <= 1 and report["speedup"] > 0
    # the speedup is over plain decoding (unpadded calls); identity is against the padded (exact) target-only run
    assert report["target_only"]["num_emitted_tokens"] == 20 == report["target_only_padded"]["num_emitted_tokens"]
    plain = report["target_only"]["tokens_per_second"]
    assert report["speedup"] == pytest.approx(report["speculative"]["tokens_per_second"] / plain, rel=1e-3)


def test_generate_command_stream_and_errors(tiny_bundle, tmp_path):
    from click.testing import CliRunner
    from runtime.cli import main

    streamed = CliRunner().invoke(
        main, ["generate", str(tiny_bundle), "def add(a, b):", "--max-new-tokens", "12", "--stream", "--threads", "1"]
    )
    assert streamed.exit_code == 0 and "acceptance rate" in streamed.output and "speedup" in streamed.output
    bad = CliRunner().invoke(main, ["generate", str(tiny_bundle), "hi", "--k", "0"])
    assert bad.exit_code != 0 and "k: expected" in bad.output
    missing = CliRunner().invoke(main, ["generate", str(tmp_path / "none"), "hi"])
    assert missing.exit_code != 0 and "no bundle at" in missing.output


@pytest.mark.parametrize(
    "pieces, stops, sent, stopped",
    [
        (["abc E", "N", "D more"], ("END",), "abc ", True),  # the stop straddles three steps: nothing of it is sent
        (["abc E", "x"], ("END",), "abc Ex", False),  # held, then sent once it cannot be a stop
        (["xxa", "bc"], ("ab", "abc"), "xx", True),  # the earliest stop wins
        (["ten ", "to one"], ("one",), "ten to ", True),
        (["no stop here"], (), "no stop here", False),
    ],
)
def test_a_stop_string_split_across_steps_never_leaks_its_first_part(pieces, stops, sent, stopped):
    from runtime.text.tokenizer import StopText

    text, got, ended = StopText(stops), [], False
    for piece in pieces:
        out, ended = text.push(piece)
        got.append(out)
        if ended:
            break
    if not ended:
        got.append(text.flush())  # the sequence ends otherwise: what was held goes out
    assert "".join(got) == text.text == sent and ended == stopped
