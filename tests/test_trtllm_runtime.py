"""The tensorrt_llm runtime adapter without TensorRT-LLM: same API as ONNX bundles, clear errors, Triton repos."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from fakes import fake_gpu_runner
from bundle_edits import copy_of

from builder.trtllm import build as trtllm
from runtime.bundle import BuildSpec, BundleError, load_manifest

NO_TRTLLM = importlib.util.find_spec("tensorrt_llm") is None


@pytest.fixture(scope="module", params=["engine", "llmapi"])
def trt_bundle(request, tiny_pair, tmp_path_factory):
    target, draft = tiny_pair
    spec = BuildSpec(
        target=str(target),
        draft=str(draft),
        target_quant="fp16",
        draft_quant="fp16",
        k=3,
        max_k=6,
        max_context=128,
        backend="tensorrt_llm",
        device="cuda",
        trtllm_flavor=request.param,
    )
    out = tmp_path_factory.mktemp("trt") / "bundle"
    trtllm.build(
        spec,
        out,
        runner=fake_gpu_runner,
        version="1.2.1",
        gpus=1,
        examples_dir=str(out.parent),
        available=lambda name: True,
    )
    return out


def _onnx_engine(bundle, manifest, entry, vocab_size: int):
    """The bundle's own ONNX engine for ``entry`` (the fused graph by default), one thread."""
    from runtime.engines.onnx import engine_class

    options = {"min_call_tokens": entry.min_call_tokens} if entry.graph == "fused" else {}
    return engine_class(entry.graph)(
        bundle / entry.engine,
        num_layers=entry.num_layers,
        num_kv_heads=entry.num_kv_heads,
        head_dim=entry.head_dim,
        vocab_size=vocab_size,
        max_context=manifest.max_context,
        threads=1,
        **options,
    )


@pytest.mark.skipif(not NO_TRTLLM, reason="checks the message shown when tensorrt_llm is absent")
def test_opening_a_trtllm_bundle_without_tensorrt_llm_says_what_to_install(trt_bundle):
    from runtime.trtllm.common import TrtllmUnavailable
    from runtime.trtllm.engine import open_generator

    with pytest.raises(TrtllmUnavailable, match=r"pip install 'draftsmith\[tensorrt\]'"):
        open_generator(trt_bundle)


def test_llm_api_kwargs_resolve_to_the_bundle(trt_bundle):
    manifest = load_manifest(trt_bundle)
    if manifest.spec.trtllm_flavor != "llmapi":
        pytest.skip("llm_api.yaml exists in llmapi bundles only")
    from runtime.trtllm.llmapi import llm_api_kwargs

    kwargs = llm_api_kwargs(trt_bundle, manifest)
    assert kwargs["model"] == str(trt_bundle.resolve() / "target/hf")
    assert kwargs["speculative_config"] == {
        "decoding_type": "DraftTarget",
        "max_draft_len": 6,
        "speculative_model": str(trt_bundle.resolve() / "draft/hf"),
    }
    assert kwargs["max_seq_len"] == 128 and Path(kwargs["model"], "config.json").is_file()
    assert "trust_remote_code" not in kwargs


def test_triton_repo_for_each_flavor(trt_bundle):
    from triton_repo.trtllm import layouts

    files = layouts.repo_for_bundle(trt_bundle)
    parsed = layouts.parse_all(files)
    if load_manifest(trt_bundle).spec.trtllm_flavor == "engine":
        target = next(c for c in parsed.values() if c.name == "tensorrt_llm")
        assert target.parameters["gpt_model_path"].string_value == str(trt_bundle / "target/engine")
    else:
        assert str(trt_bundle.resolve() / "draft/hf") in files["tensorrt_llm/1/model.yaml"]


def test_onnx_bundles_have_no_trtllm_layout(tiny_bundle):
    from triton_repo.trtllm import layouts
    from triton_repo.pbtxt import ConfigError

    with pytest.raises(ConfigError, match="onnxruntime bundle"):
        layouts.repo_for_bundle(tiny_bundle)


def test_open_generator_serves_onnx_bundles_too(tiny_bundle):
    from runtime.api import SpeculativeGenerator
    from runtime.trtllm.engine import open_generator

    assert isinstance(open_generator(tiny_bundle, threads=1), SpeculativeGenerator)


# --- engine flavor: the target verifies external draft tokens (what draft_tokens_external engines support) -----------


class GreedyExecutor:
    """ExecutorSession's contract on CPU: greedy tokens after each history; with drafts, the target's verification
    (accepted draft tokens, then the target's own next token), each request computed by a fresh ONNX run."""

    def __init__(self, engine):
        self.engine = engine

    def _next(self, ids: list[int]) -> list[int]:
        cache = self.engine.new_cache(1)
        logits = self.engine.forward(cache, np.asarray([ids], np.int64))
        return [int(t) for t in logits[0].argmax(-1)]

    def generate(self, histories, max_tokens, drafts=None):
        out = []
        for row, history in enumerate(histories):
            draft = drafts[row] if drafts else []
            if draft:
                predicted = self._next(history + draft)[len(history) - 1 :]
                accepted = 0
                while accepted < len(draft) and draft[accepted] == predicted[accepted]:
                    accepted += 1
                out.append((draft[:accepted] + [predicted[accepted]])[: max_tokens[row]])
                continue
            tokens = []
            while len(tokens) < max_tokens[row]:
                tokens.append(self._next(history + tokens)[-1])
            out.append(tokens)
        return out


def executor_pair(bundle, vocab_size: int, tokenizer):
    """The tiny bundle's pair as an engine-flavor bundle opens it (two ``ExecutorEngine``s), over CPU stand-ins for
    the executors, in a SpeculativeGenerator: the scheduler's path for every bundle."""
    from runtime.api import SpeculativeGenerator
    from runtime.trtllm.engine import ExecutorEngine

    manifest = load_manifest(bundle, verify=False)
    engines = {
        entry.role: ExecutorEngine(
            GreedyExecutor(_onnx_engine(bundle, manifest, entry, vocab_size)),
            vocab_size=vocab_size,
            max_context=manifest.max_context,
            verifies=entry.role == "target",
        )
        for entry in (manifest.target, manifest.draft)
    }
    return SpeculativeGenerator(manifest, engines["target"], engines["draft"], tokenizer, manifest.eos_token_ids)


def test_the_scheduler_decodes_the_executor_pair_to_the_target_greedy_output(tiny_bundle, generator):
    spec = executor_pair(tiny_bundle, generator.target.vocab_size, generator.tokenizer)
    prompts = ["The quick brown fox", "def add(a, b):"]
    want = generator.generate(prompts, max_new_tokens=12, mode="target")
    got = spec.generate(prompts, max_new_tokens=12, k=3)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.text for g in got] == [w.text for w in want]
    assert all(g.stats.num_draft_tokens > 0 and g.stats.num_accepted_tokens <= g.stats.num_draft_tokens for g in got)
    alone = spec.generate(prompts[0], max_new_tokens=12, mode="target")
    assert alone.token_ids == want[0].token_ids and alone.stats.num_draft_tokens == 0
    for drafter in ("prompt_lookup", "suffix", "hybrid", "hybrid_suffix"):  # every drafter's tokens verified alike
        got = spec.generate(prompts, max_new_tokens=12, drafter=drafter)
        assert [g.token_ids for g in got] == [w.token_ids for w in want], drafter


def test_each_step_is_one_draft_call_and_one_target_call(tiny_bundle, generator):
    """The step calls the two engines as it calls an ONNX pair: the draft once (its k tokens in one request), the
    target once (verifying them), every call observed."""
    from runtime.core.request import Asked, decode_request

    spec = executor_pair(tiny_bundle, generator.target.vocab_size, generator.tokenizer)
    calls = {"target": [], "draft": []}
    spec.target.watch(calls["target"].append)
    spec.draft.watch(calls["draft"].append)
    steps = []
    admitted = spec.door.admit(Asked(["The quick brown fox"], {}, base=decode_request(max_new_tokens=9, k=3)))
    for _ in spec.run(admitted, on_step=steps.append):
        pass
    assert [c.kind for c in calls["target"]].count("generate_tokens") == len(steps)
    assert [c.kind for c in calls["draft"]] == ["generate_tokens"] * len(calls["draft"]) and 0 < len(
        calls["draft"]
    ) <= len(steps)


def test_the_front_door_refuses_what_an_engine_that_returns_tokens_cannot_do(tiny_bundle, generator):
    from runtime.errors import RequestError

    spec = executor_pair(tiny_bundle, generator.target.vocab_size, generator.tokenizer)
    for asked, field in (
        ({"temperature": 0.7}, "temperature"),
        ({"logprobs": 2}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ):
        with pytest.raises(RequestError, match="in-process they decode greedily") as err:
            spec.generate("hi", **asked)
        assert err.value.field == field


def test_the_pinned_executor_calls_run_under_the_scheduler(trt_bundle, monkeypatch):
    """An engine-flavor bundle opened with the upstream-pinned stand-in (tests/test_trtllm_mismatches.py: the
    executor answers a request with its draft tokens, all accepted, then 7): the scheduler's steps send each row's
    drafts as ``ExternalDraftTokensConfig`` and take what the target returns."""
    from test_trtllm_mismatches import install_fake_trtllm

    from runtime.trtllm.engine import open_generator

    if load_manifest(trt_bundle).spec.trtllm_flavor != "engine":
        pytest.skip("the executor pair is the engine flavor's")
    install_fake_trtllm(monkeypatch)
    spec = open_generator(trt_bundle)
    got = spec.generate(["hi", "there"], max_new_tokens=7, k=3)
    assert [g.token_ids for g in got] == [[7] * 7] * 2
    assert all(g.stats.num_accepted_tokens == g.stats.num_draft_tokens > 0 for g in got)


class PinnedLLM:
    """The LLM API's ``LLM.generate`` on CPU, held to upstream's interface (tests/fixtures/trtllm/sampling_params.json):
    only ``generate``'s own keywords, one pinned ``SamplingParams`` per token-id prompt. A greedy one continues with
    the target's argmax; a sampled one draws each token from the target's law under its temperature, top-k and
    top-p with a generator seeded by its ``seed`` alone (what a seeded executor request is: the same seed, the same
    tokens). Records every call's (prompt, SamplingParams) pairs in ``calls``."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.answer = self._continue  # (history, params) -> tokens; a test replaces it to end every row

    def generate(self, inputs, sampling_params=None, use_tqdm=True, **options):
        import types

        from test_trtllm_mismatches import SAMPLING, FakeSamplingParams

        assert set(options) <= set(SAMPLING["generate_parameters"]), options
        assert isinstance(sampling_params, list) and len(sampling_params) == len(inputs)
        assert all(isinstance(p, FakeSamplingParams) for p in sampling_params)
        assert all(isinstance(i, list) and all(isinstance(t, int) for t in i) for i in inputs)  # token-id prompts
        self.calls.append([(list(i), p) for i, p in zip(inputs, sampling_params)])
        out = [self.answer(list(i), p) for i, p in zip(inputs, sampling_params)]
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=tokens)]) for tokens in out]

    def _continue(self, history: list[int], params) -> list[int]:
        from runtime.decoding.sampling import SamplingParams, probabilities, sample

        rng = None if params.greedy else np.random.default_rng(params.seed)
        law = None if params.greedy else SamplingParams(params.temperature, params.top_k or None, params.top_p)
        tokens = []
        while len(tokens) < params.max_tokens:
            logits = self.engine.forward(self.engine.new_cache(1), np.asarray([history + tokens], np.int64))[0, -1]
            tokens.append(int(logits.argmax()) if rng is None else sample(probabilities(logits, law), rng))
        return tokens


def llm_api_generator(bundle, generator, monkeypatch, speculative: bool = True):
    """An llmapi bundle's generator as ``open_llm_api`` makes it, over ``PinnedLLM`` (the tiny target) and the
    pinned ``tensorrt_llm`` stand-in; returns (generator, llm)."""
    from test_trtllm_mismatches import install_fake_trtllm

    from runtime.api import SpeculativeGenerator
    from runtime.trtllm.llmapi import LlmApiEngine

    install_fake_trtllm(monkeypatch)
    manifest = load_manifest(bundle, verify=False)
    vocab = generator.target.vocab_size
    llm = PinnedLLM(_onnx_engine(bundle, manifest, manifest.target, vocab))
    engine = LlmApiEngine(
        llm, vocab_size=vocab, max_context=manifest.max_context, step_tokens=4, speculative=speculative
    )
    return SpeculativeGenerator(manifest, engine, None, generator.tokenizer, manifest.eos_token_ids), llm


def test_the_scheduler_drives_an_engine_that_speculates_inside_in_one_call_steps(tiny_bundle, generator, monkeypatch):
    from runtime.errors import RequestError

    spec, llm = llm_api_generator(tiny_bundle, generator, monkeypatch)
    prompts = ["The quick brown fox", "def add(a, b):"]
    want = generator.generate(prompts, max_new_tokens=10, mode="target")
    got = spec.generate(prompts, max_new_tokens=10)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert len(llm.calls) == 3  # one call a step, each up to step_tokens a row: 4 + 4 + 2
    for _, params in (pair for call in llm.calls for pair in call):  # greedy as before: temperature 0.0 alone
        assert params.given == {"max_tokens": params.max_tokens, "temperature": 0.0} and params.greedy
    baseline, _ = llm_api_generator(tiny_bundle, generator, monkeypatch, speculative=False)
    assert [g.token_ids for g in baseline.generate(prompts, max_new_tokens=10)] == [w.token_ids for w in want]
    llm.answer = lambda history, params: []  # it stops each row (its end id left out)
    ended = spec.generate(prompts[0], max_new_tokens=10)
    assert ended.token_ids == [] and ended.finish_reason == "stop"
    for asked in ({"mode": "target"}, {"drafter": "prompt_lookup"}):
        with pytest.raises(RequestError, match="inside TensorRT-LLM's executor"):
            spec.generate("hi", **asked)


def test_sampled_rows_reach_the_llm_each_with_its_own_parameters(tiny_bundle, generator, monkeypatch):
    """Two sampled requests and a greedy one share each step's one call: each row's SamplingParams carries its own
    temperature, top-k, top-p and a seed of that step (a fresh one each step, so no two steps replay the same
    draws); the greedy row's is what it always was."""
    from door_path import submit

    from runtime.core.scheduler import Scheduler

    spec, llm = llm_api_generator(tiny_bundle, generator, monkeypatch)
    scheduler = Scheduler(spec, max_batch=4, prefill_chunk=None)
    asked = [dict(temperature=0.7, seed=1), dict(temperature=1.3, top_k=5, top_p=0.9, seed=2), dict(temperature=0.0)]
    sent = [submit(scheduler, p, max_new_tokens=8, **a) for p, a in zip(["Hello", "Once upon", "def f("], asked)]
    while scheduler.busy:
        scheduler.step()
    results = [s.result() for s in sent]
    assert all(len(r.token_ids) == 8 or r.finish_reason == "stop" for r in results)
    first = llm.calls[0]
    assert len(first) == 3  # the three rows in one call
    warm, hot, cold = (params for _, params in first)  # in the order they came
    assert (warm.temperature, warm.top_k, warm.top_p) == (0.7, 0, 1.0) and not warm.greedy  # no top-k, no nucleus
    assert (hot.temperature, hot.top_k, hot.top_p) == (1.3, 5, 0.9) and not hot.greedy
    assert cold.given == {"max_tokens": cold.max_tokens, "temperature": 0.0} and cold.seed is None
    assert isinstance(hot.seed, int) and isinstance(warm.seed, int) and hot.seed != warm.seed
    seeds = [params.seed for call in llm.calls for _, params in call[:1]]  # the first row's seed, step by step
    assert len(seeds) > 1 and len(set(seeds)) == len(seeds)


def test_a_seeded_sampled_request_repeats_and_another_seed_differs(tiny_bundle, generator, monkeypatch):
    """Through the pinned stand-in's seeded sampling: the same seed gives the same tokens (alone or batched), other
    seeds other tokens; greedy output is the target's own."""
    spec, _ = llm_api_generator(tiny_bundle, generator, monkeypatch)
    options = dict(max_new_tokens=10, temperature=1.5)
    once = spec.generate("The quick brown fox", seed=7, **options).token_ids
    assert spec.generate("The quick brown fox", seed=7, **options).token_ids == once
    batched = spec.generate(["def add(a, b):", "The quick brown fox"], seed=[3, 7], **options)
    assert batched[1].token_ids == once
    others = {tuple(spec.generate("The quick brown fox", seed=s, **options).token_ids) for s in (8, 9, 10)}
    assert others - {tuple(once)}
    want = generator.generate("The quick brown fox", max_new_tokens=10, mode="target").token_ids
    assert spec.generate("The quick brown fox", max_new_tokens=10).token_ids == want


def test_an_llm_api_bundle_still_refuses_what_it_cannot_do(tiny_bundle, generator, monkeypatch):
    from runtime.errors import RequestError

    spec, _ = llm_api_generator(tiny_bundle, generator, monkeypatch)
    for asked, field in (
        ({"logprobs": 2}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ):
        with pytest.raises(RequestError, match="with sampling but without constraints or log-probabilities") as err:
            spec.generate("hi", temperature=0.5, **asked)
        assert err.value.field == field


def test_llm_sampling_params_read_the_same_in_both_pinned_releases(monkeypatch):
    """Each SamplingParams the engine builds is one both read releases agree on (greedy or sampled), and values
    they read apart are what the pinned stand-in refuses: temperature alone is greedy in 1.0.0rc4."""
    from test_trtllm_mismatches import FakeSamplingParams, install_fake_trtllm

    from runtime.decoding.sampling import RowSampling, SamplingParams
    from runtime.trtllm.llmapi import llm_sampling_params

    install_fake_trtllm(monkeypatch)
    assert llm_sampling_params(3, None).greedy
    for params in (SamplingParams(0.5), SamplingParams(2.0, top_k=1), SamplingParams(0.8, top_p=0.5)):
        built = llm_sampling_params(3, RowSampling(params, 11))
        assert built.seed == 11 and built.max_tokens == 3
        assert built.greedy == (params.top_k == 1)  # top_k 1 is greedy in both
    with pytest.raises(ValueError, match="decode .* apart"):
        assert FakeSamplingParams(temperature=0.5).greedy
    with pytest.raises(TypeError, match="unexpected keyword argument 'random_seed'"):
        FakeSamplingParams(random_seed=3)  # the executor's deprecated name, not SamplingParams'


# --- a bundle's llm_api.yaml never grants consent or points outside the bundle ----------------------------------------

HOSTILE_LLM_API = [
    ({"trust_remote_code": True}, "trust_remote_code: not a key a bundle may set"),
    ({"backend": "tensorrt"}, "backend: not a key"),
    ({"checkpoint_loader": "evil.module:Loader"}, "checkpoint_loader: not a key"),
    ({"model": "/etc"}, "model: expected a relative path inside the bundle"),
    ({"model": "../../outside"}, "model: expected a path inside the bundle"),
    ({"tokenizer": 7}, "tokenizer: expected a relative path"),
    ({"max_batch_size": -1}, "max_batch_size: expected an integer >= 1"),
    ({"dtype": "float32; rm -rf"}, "dtype: expected one of"),
    (
        {
            "speculative_config": {
                "decoding_type": "DraftTarget",
                "max_draft_len": 4,
                "speculative_model": "/models/other",
            }
        },
        "speculative_config.speculative_model",
    ),
    (
        {
            "speculative_config": {
                "decoding_type": "DraftTarget",
                "max_draft_len": 4,
                "speculative_model": "draft/hf",
                "trust_remote_code": True,
            }
        },
        "speculative_config.trust_remote_code",
    ),
    (
        {"speculative_config": {"decoding_type": "Eagle", "max_draft_len": 4, "speculative_model": "draft/hf"}},
        "speculative_config.decoding_type",
    ),
    ({"speculative_config": "draft/hf"}, "speculative_config: expected a mapping"),
]


@pytest.mark.parametrize("change,message", HOSTILE_LLM_API, ids=[m.split(":")[0] for _, m in HOSTILE_LLM_API])
def test_hostile_llm_api_yaml_is_refused_naming_the_key(trt_bundle, tmp_path, change, message):
    import shutil

    import yaml

    from runtime.bundle import BundleError
    from runtime.trtllm.llmapi import llm_api_kwargs

    manifest = load_manifest(trt_bundle)
    if manifest.spec.trtllm_flavor != "llmapi":
        pytest.skip("llm_api.yaml exists in llmapi bundles only")
    bundle = tmp_path / "bundle"
    shutil.copytree(trt_bundle, bundle)
    data = yaml.safe_load((bundle / "llm_api.yaml").read_text())
    (bundle / "llm_api.yaml").write_text(yaml.safe_dump({**data, **change}), encoding="utf-8")
    with pytest.raises(BundleError, match="sha256 differs"):  # read once and hashed: a swapped file is refused
        llm_api_kwargs(bundle, manifest)
    import dataclasses
    import hashlib

    digest = hashlib.sha256((bundle / "llm_api.yaml").read_bytes()).hexdigest()
    forged = dataclasses.replace(manifest, files={**manifest.files, "llm_api.yaml": digest})  # a consistent forgery
    with pytest.raises(BundleError, match="llm_api.yaml is refused") as err:
        llm_api_kwargs(bundle, forged)
    assert message in str(err.value)


def test_build_engines_triton_repo_writes_the_trtllm_layout(trt_bundle, tmp_path):
    from builder.cli import _write_triton_repo

    _write_triton_repo(trt_bundle, tmp_path / "repo", False)
    flavor = load_manifest(trt_bundle).spec.trtllm_flavor
    expected = "tensorrt_llm_bls/config.pbtxt" if flavor == "engine" else "tensorrt_llm/1/model.yaml"
    assert (tmp_path / "repo" / expected).is_file()


def test_open_generator_loads_what_it_verified(tiny_bundle, tmp_path, monkeypatch):
    """open_generator verified the bundle, then loaded it again with verify=False: an engine swapped in between
    loaded unchecked. Now the loader verifies the bytes it loads."""
    import runtime.trtllm.engine
    from runtime.trtllm.engine import open_generator

    root = copy_of(tiny_bundle, tmp_path / "b")
    swapped = (root / "draft" / "model.onnx").read_bytes()  # another valid engine
    real = runtime.trtllm.engine.load_manifest

    def verify_then_swap(path, verify=True):
        manifest = real(path, verify=verify)
        (root / "target" / "model.onnx").write_bytes(swapped)
        return manifest

    monkeypatch.setattr(runtime.trtllm.engine, "load_manifest", verify_then_swap)
    with pytest.raises(BundleError, match="target/model.onnx: sha256 differs from the manifest"):
        open_generator(root, threads=1)
