"""The feature draft: the target's hidden states out of its engine, the draft trained on them, built into a bundle,
and the feature drafter's output exact (greedy identity on ONNX engines, the target's law under sampling)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fakes import LENGTH, BigramEngine, assert_follows_target, last_positions, random_table, run_loop
from door_path import submit
from runtime.engines.base import KVCache
from runtime.drafters.feature import FeatureDrafter
from runtime.decoding.sampling import SamplingParams, probabilities
from runtime.decoding.config import DecodeConfig
from batch_run import BatchRun

# --- the drafter's bookkeeping against fakes with a known law ----------------------------------------------------

VOCAB = 5


class HiddenBigram(BigramEngine):
    """A bigram target whose 'hidden state' after token a is one-hot(a) with a last flag 1 (came from the target)."""

    has_hidden = True

    def compute(self, cache: KVCache, tokens: np.ndarray, valid: np.ndarray | None = None, **options):
        logits = super().compute(cache, tokens, valid, **options)
        cache.extra["hidden"] = states(tokens, 1.0)
        return logits


def states(tokens: np.ndarray, flag: float) -> np.ndarray:
    hidden = np.zeros(tokens.shape + (VOCAB + 1,), np.float32)
    hidden[..., :VOCAB] = np.eye(VOCAB)[tokens]
    hidden[..., VOCAB] = flag
    return hidden


class FakeFeatureDraft(BigramEngine):
    """A feature draft whose law depends on what it is fed: for a pair (f, t) with a target's f (flag 1) the logits
    are first[t] + by_feature[token of f]; for one of its own predictions (flag 0), chained[t]. Its prediction of
    the next state is one-hot(t), flag 0. A drafter that paired the wrong states with the tokens, or kept its own
    predictions as if they were the target's, would draft from another law, and the acceptance check would see it."""

    takes_features = True

    def __init__(self, first, by_feature, chained):
        super().__init__(first)
        self.first, self.by_feature, self.chained = first, by_feature, chained
        self.true_pairs = set()  # (token whose state it is, the token fed with it) for every target state fed

    def compute(self, cache, tokens, valid=None, *, last=False, features=None, **_):
        super().compute(cache, tokens, valid)
        true = features[..., VOCAB:] > 0.5
        live = true[..., 0] & (np.ones_like(tokens) if valid is None else valid).astype(bool)
        self.true_pairs |= set(zip(features[..., :VOCAB].argmax(-1)[live].tolist(), tokens[live].tolist()))
        logits = np.where(
            true, self.first[tokens] + self.by_feature[features[..., :VOCAB].argmax(-1)], self.chained[tokens]
        )
        cache.extra["hidden"] = states(tokens, 0.0)
        return last_positions(logits, valid) if last else logits


def test_feature_drafting_follows_the_target_distribution():
    params = SamplingParams(1.0)
    target = random_table(VOCAB, 1)
    first, by_feature, chained = random_table(VOCAB, 2), random_table(VOCAB, 3), random_table(VOCAB, 4)
    n, start, before = 20000, 0, 3  # prompt [3, 0]: the prefill's state after 3 pairs with 0
    drafter = FeatureDrafter(FakeFeatureDraft(first, by_feature, chained))
    loop = BatchRun(HiddenBigram(target), drafter, [[before, start]] * n, DecodeConfig(LENGTH, 3, params, seed=5))
    counts = run_loop(loop)
    p = probabilities(target, params)
    q1 = np.tile(probabilities(first[start] + by_feature[before], params), (VOCAB, 1))  # position 1 follows start only
    q_chained = probabilities(chained, params)
    assert_follows_target(loop.rows, counts, p, start, [q1, q_chained, q_chained])


class ReducedFeatureDraft(FakeFeatureDraft):
    """FakeFeatureDraft with a reduced head: logits over ``kept`` ids only (column j is token kept[j]), as a draft
    distilled with ``draft_vocab`` returns them."""

    def __init__(self, kept, *tables):
        super().__init__(*tables)
        self.kept = np.asarray(kept)

    def compute(self, cache, tokens, valid=None, **options):
        return super().compute(cache, tokens, valid, **options)[..., self.kept]


def test_a_reduced_head_feature_draft_follows_the_target_distribution():
    """The draft's law is zero outside its kept ids (runtime.engines.mapped.MappedVocabEngine): tokens it can never
    propose come back through the residual, and the output still follows the target's law exactly."""
    from runtime.engines.mapped import MappedVocabEngine

    params = SamplingParams(1.0)
    target = random_table(VOCAB, 1)
    first, by_feature, chained = random_table(VOCAB, 2), random_table(VOCAB, 3), random_table(VOCAB, 4)
    kept = [0, 2, 3]  # tokens 1 and 4 are never drafted
    n, start, before = 20000, 0, 3
    engine = MappedVocabEngine(ReducedFeatureDraft(kept, first, by_feature, chained), kept, VOCAB)
    loop = BatchRun(
        HiddenBigram(target), FeatureDrafter(engine), [[before, start]] * n, DecodeConfig(LENGTH, 3, params, seed=6)
    )
    counts = run_loop(loop)
    outside = np.full(VOCAB, -np.inf)
    outside[kept] = 0.0
    q1 = np.tile(probabilities(first[start] + by_feature[before] + outside, params), (VOCAB, 1))
    q_chained = probabilities(chained + outside, params)
    assert q_chained[:, [1, 4]].max() == 0.0
    assert_follows_target(loop.rows, counts, probabilities(target, params), start, [q1, q_chained, q_chained])
    emitted = {t for row in loop.rows for t in row.generated}
    assert {1, 4} <= emitted  # the target's own tokens outside the draft's head still come out


def test_feature_drafter_drops_its_own_predictions_and_keeps_the_targets():
    """Between steps the draft cache holds only true pairs: fed pairs + pending ones = every token but the first."""
    engine = FakeFeatureDraft(random_table(VOCAB, 2), random_table(VOCAB, 3), random_table(VOCAB, 4))
    drafter = FeatureDrafter(engine)
    loop = BatchRun(
        HiddenBigram(random_table(VOCAB, 1)),
        drafter,
        [[1, 2, 3], [4, 0]],
        DecodeConfig(40, 3, SamplingParams(1.0), seed=0),
    )
    steps = 0
    for _ in loop.run():
        if any(r.finished for r in loop.rows):
            break
        steps += 1
        for b, row in enumerate(loop.rows):
            assert int(drafter.cache.lengths[b]) + len(drafter.tokens[b]) == row.total - 1
            assert sum(len(f) for f in drafter.features[b]) == len(drafter.tokens[b])
    assert steps > 3 and drafter.calls > steps
    # every target state went in with the token that followed it: pairs of consecutive tokens of some row
    consecutive = {
        pair for row in loop.rows for pair in zip(row.prompt + row.generated, (row.prompt + row.generated)[1:])
    }
    assert engine.true_pairs and engine.true_pairs <= consecutive


def test_the_feature_drafter_refuses_a_plain_draft_engine():
    with pytest.raises(ValueError, match="feature draft"):
        FeatureDrafter(BigramEngine(random_table(VOCAB, 2)))


# --- real engines --------------------------------------------------------------------------------------------------


def test_the_target_engine_returns_torchs_final_hidden_states(learnable_target, tmp_path):  # noqa: F811
    import torch

    from builder import checkpoint as ckpt
    from builder.distill.continuations import Job, generate_with_engine, target_engine

    checkpoint = ckpt.resolve(str(learnable_target[0]))
    model = checkpoint.load_model()
    engine = target_engine(model, checkpoint, tmp_path, "fp32", 4, max_context=64, threads=1)
    rng = random.Random(1)
    prompts = [[rng.randrange(4, 300) for _ in range(rng.randint(2, 9))] for _ in range(5)]
    jobs = [Job(p) for p in prompts] + [Job(p, 1.0, prompt_rows=False) for p in prompts]
    made = generate_with_engine(engine, jobs, 6, top_k=4, eos_ids=[2], batch_size=3, features=True)
    for sample in made:
        with torch.no_grad():
            out = model(torch.tensor([sample.ids]), output_hidden_states=True)
        reference = out.hidden_states[-1][0, :-1].numpy()  # after the final norm: what the head reads
        assert sample.features.shape == reference.shape
        np.testing.assert_allclose(sample.features.astype(np.float32), reference, atol=2e-2, rtol=1e-2)


@pytest.fixture(scope="module")
def feature_bundle(per_token_target, tmp_path_factory):
    """A feature draft distilled for ``per_token_target`` and the bundle of both."""
    import torch

    from builder.build import build
    from builder.distill.pipeline import distill_draft
    from builder.distill.recipe import DistillRecipe
    from runtime.bundle import BuildSpec

    torch.set_num_threads(1)
    target, prompts = per_token_target
    root = tmp_path_factory.mktemp("feature")
    recipe = DistillRecipe(
        init="feature", prompts=prompts, max_new_tokens=24, train_steps=150, seed=0, heldout=0.2, draft_vocab=200
    )
    report = distill_draft(recipe, str(target), root / "draft", quiet=True)
    spec = BuildSpec(
        target=str(target), draft=str(root / "draft"), target_quant="fp32", draft_quant="fp32", k=3, max_context=128
    )
    manifest = build(spec, root / "bundle")
    return root / "bundle", report, manifest


def test_feature_distillation_learns_and_the_bundle_reports_it(feature_bundle):
    _, report, manifest = feature_bundle
    before, after = report["before"]["chained"], report["after"]["chained"]
    assert report["draft_kind"] == "feature" and report["draft_vocab"] == 200
    # measured: top-1 0.01 -> 0.97, the chain's second token 0.0 -> 0.83 (held-out prompts, never trained on)
    assert after["top1"] >= before["top1"] + 0.5, (before, after)
    assert after["per_position"][1] >= before["per_position"][1] + 0.3
    assert manifest.draft.num_layers == 1 and "features" in manifest.draft.input_names
    assert "hidden" in manifest.target.output_names
    checks = manifest.report["export_check_max_abs_logit_diff"]["draft"]
    assert set(checks) == {"pairs", "chain_1", "chain_2"} and max(checks.values()) < 1e-3
    print(report["after"], manifest.report["draft_target_top1_agreement"])
    assert manifest.report["draft_target_top1_agreement"] > 0.2  # eval.txt: prose outside the training words


def test_feature_speculative_greedy_equals_target_only(feature_bundle):
    from runtime.api import SpeculativeGenerator

    gen = SpeculativeGenerator.from_bundle(feature_bundle[0], threads=1)
    prompts = ["the quick brown fox", "def add return for range", "lazy dog keeps"]
    spec = gen.generate(prompts, max_new_tokens=24, k=3, drafter="model", plan=False)  # k=3 at every step
    plain = gen.generate(prompts, max_new_tokens=24, mode="target")
    assert [r.text for r in spec] == [r.text for r in plain]
    drafted = sum(r.stats.num_draft_tokens for r in spec)
    accepted = sum(r.stats.num_accepted_tokens for r in spec)
    assert drafted > 30 and 0 < accepted < drafted
    hybrid = gen.generate(prompts, max_new_tokens=24, k=3, drafter="hybrid")
    assert [r.text for r in hybrid] == [r.text for r in plain]


def test_a_feature_draft_for_another_target_is_refused(feature_bundle, tmp_path):
    import json
    import shutil

    from builder.build import build

    from builder.errors import BuildError
    from runtime.bundle import BuildSpec

    manifest = feature_bundle[2]
    draft = tmp_path / "draft"
    shutil.copytree(manifest.draft.source, draft)
    config = json.loads((draft / "feature_draft.json").read_text())
    config["target_sha256"] = "0" * 64
    (draft / "feature_draft.json").write_text(json.dumps(config))
    spec = BuildSpec(
        target=manifest.spec.target, draft=str(draft), target_quant="fp32", draft_quant="fp32", max_context=128
    )
    with pytest.raises(BuildError, match="another target"):
        build(spec, tmp_path / "bundle")


@pytest.mark.parametrize(
    "change, message",
    [({"max_positions": 10**12}, "does not match the target"), ({"kind": "other"}, "kind"), (None, "kind")],
)
def test_a_hostile_feature_draft_config_is_refused(feature_bundle, tmp_path, change, message):
    """feature_draft.json is data: numbers that would size the graph past the target's (a 10^12-position rotary
    table), another kind, or no object at all get a clear error before anything is built."""
    import json
    import shutil

    from builder.build import build

    from builder.errors import BuildError
    from runtime.bundle import BuildSpec

    manifest = feature_bundle[2]
    draft = tmp_path / "draft"
    shutil.copytree(manifest.draft.source, draft)
    config = json.loads((draft / "feature_draft.json").read_text())
    (draft / "feature_draft.json").write_text(json.dumps([1] if change is None else {**config, **change}))
    spec = BuildSpec(
        target=manifest.spec.target, draft=str(draft), target_quant="fp32", draft_quant="fp32", max_context=128
    )
    with pytest.raises(BuildError, match=message):
        build(spec, tmp_path / "bundle")
    assert not (tmp_path / "bundle").exists()


@pytest.mark.parametrize("policy", ["exact", "throughput"])
def test_the_scheduler_feeds_the_feature_drafter_as_a_lone_request_does(feature_bundle, policy):
    """In-flight batching: requests admitted mid-flight, each with its own feature drafter fed from the shared
    target calls, get the tokens they get alone, with drafts proposed and accepted."""
    from runtime.api import SpeculativeGenerator
    from runtime.core.scheduler import Scheduler

    gen = SpeculativeGenerator.from_bundle(feature_bundle[0], threads=1)
    scheduler = Scheduler(gen, max_batch=3, policy=policy)
    prompts = ["the quick brown fox", "def add return", "lazy dog keeps target", "over the"]
    handles = [submit(scheduler, p, max_new_tokens=20, k=3) for p in prompts[:2]]
    scheduler.step()
    handles += [submit(scheduler, p, max_new_tokens=20, k=2) for p in prompts[2:]]
    while scheduler.step():
        pass
    for prompt, handle, k in zip(prompts, handles, (3, 3, 2, 2)):
        got, alone = handle.result(), gen.generate(prompt, max_new_tokens=20, k=k)
        assert got.token_ids == alone.token_ids
    assert sum(h.result().stats.num_accepted_tokens for h in handles) > 10


@pytest.mark.parametrize("policy", ["throughput", "exact"])
def test_the_cost_model_starts_on_a_feature_draft(feature_bundle, policy):
    """The step plan times the draft at start: a feature draft takes features, which the calibration must give it.
    Answers stay greedy-exact for the fp32 target."""
    from runtime.api import SpeculativeGenerator
    from runtime.core.scheduler import Scheduler

    gen = SpeculativeGenerator.from_bundle(feature_bundle[0], threads=1)
    scheduler = Scheduler(gen, max_batch=2, policy=policy).start()
    try:
        assert min(scheduler.costs.draft.values()) > 0 and scheduler.costs.calibrated
        got = submit(scheduler, "the quick brown fox", max_new_tokens=12, k=2).result()
    finally:
        scheduler.stop()
    assert got.token_ids == gen.generate("the quick brown fox", max_new_tokens=12, k=2).token_ids


def test_profile_runs_a_feature_draft_bundle(feature_bundle):
    """draftsmith profile feeds a feature draft the features input it takes (zeros of its width)."""
    from bench.profile import profile_bundle

    report = profile_bundle(feature_bundle[0], threads=1, past=8, new=2, calls=3)
    assert report["draft"]["calls"] == 3 and report["draft"]["mean_call_ms"] > 0


def test_the_feature_drafter_drafts_on_after_grammar_forced_tokens():
    """A grammar's forced tokens go through the draft's chain like drawn ones (its own predicted features), and the
    draft draws on from there with the law that chain gives: q after forced [2, 1] is chained[1]'s."""
    from runtime.drafters.hybrid import HybridDrafter

    params = SamplingParams(1.0)
    first, by_feature, chained = random_table(VOCAB, 2), random_table(VOCAB, 3), random_table(VOCAB, 4)
    drafter = FeatureDrafter(FakeFeatureDraft(first, by_feature, chained))
    drafter.start([[3, 0]])
    drafter.take_features([states(np.array([3]), 1.0)])  # the prefill's state after 3 pairs with 0
    out = drafter.propose([4], params, [np.random.default_rng(0)], prefixes=[[2, 1]])
    tokens, probs = out.tokens[0], out.probs[0]
    assert tokens[:2] == [2, 1] and len(tokens) == 4 and drafter.calls == 4  # the true pair, 2, 1, the 3rd token
    assert probs[0][2] == 1.0 and probs[1][1] == 1.0
    assert np.allclose(probs[2], probabilities(chained[1], params))
    assert np.allclose(probs[3], probabilities(chained[tokens[2]], params))
    hybrid = HybridDrafter(FeatureDrafter(FakeFeatureDraft(first, by_feature, chained)), VOCAB)
    assert hybrid.takes_prefixes
    hybrid.start([[3, 0]])
    hybrid.take_features([states(np.array([3]), 1.0)])
    assert hybrid.propose([3], params, [np.random.default_rng(0)], prefixes=[[2]]).tokens[0][0] == 2
