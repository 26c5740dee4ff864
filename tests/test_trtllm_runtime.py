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
        with pytest.raises(RequestError, match="greedily in-process") as err:
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


class GreedyLLM:
    """The LLM API's ``generate(inputs, sampling_params, use_tqdm)`` on CPU: token-id prompts, one SamplingParams
    each, greedy continuations up to its max_tokens (what an executor speculating inside itself returns)."""

    def __init__(self, engine):
        self.executor, self.calls = GreedyExecutor(engine), 0

    def generate(self, inputs, sampling_params, use_tqdm=True):
        import types

        self.calls += 1
        out = self.executor.generate(inputs, [p.max_tokens for p in sampling_params])
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=tokens)]) for tokens in out]


def test_the_scheduler_drives_an_engine_that_speculates_inside_in_one_call_steps(tiny_bundle, generator, monkeypatch):
    import sys
    import types

    from runtime.api import SpeculativeGenerator
    from runtime.errors import RequestError
    from runtime.trtllm.llmapi import LlmApiEngine

    monkeypatch.setitem(sys.modules, "tensorrt_llm", types.SimpleNamespace(SamplingParams=types.SimpleNamespace))
    manifest = load_manifest(tiny_bundle, verify=False)
    vocab = generator.target.vocab_size
    llm = GreedyLLM(_onnx_engine(tiny_bundle, manifest, manifest.target, vocab))
    engine = LlmApiEngine(llm, vocab_size=vocab, max_context=manifest.max_context, step_tokens=4)
    spec = SpeculativeGenerator(manifest, engine, None, generator.tokenizer, manifest.eos_token_ids)
    prompts = ["The quick brown fox", "def add(a, b):"]
    want = generator.generate(prompts, max_new_tokens=10, mode="target")
    got = spec.generate(prompts, max_new_tokens=10)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert llm.calls == 3  # one call a step, each up to step_tokens a row: 4 + 4 + 2
    engine = LlmApiEngine(llm, vocab_size=vocab, max_context=manifest.max_context, step_tokens=4, speculative=False)
    baseline = SpeculativeGenerator(manifest, engine, None, generator.tokenizer, manifest.eos_token_ids)
    assert [g.token_ids for g in baseline.generate(prompts, max_new_tokens=10)] == [w.token_ids for w in want]
    llm.executor.generate = lambda inputs, most: [[] for _ in inputs]  # it stops each row (its end id left out)
    ended = spec.generate(prompts[0], max_new_tokens=10)
    assert ended.token_ids == [] and ended.finish_reason == "stop"
    for asked in ({"mode": "target"}, {"drafter": "prompt_lookup"}):
        with pytest.raises(RequestError, match="inside TensorRT-LLM's executor"):
            spec.generate("hi", **asked)


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
