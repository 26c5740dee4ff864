"""The tensorrt_llm runtime adapter without TensorRT-LLM: same API as ONNX bundles, clear errors, Triton repos."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from fakes import fake_gpu_runner

from builder.trtllm import build as trtllm
from runtime.bundle import BuildSpec, load_manifest

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


def test_speculative_generator_over_the_adapter_matches_the_onnx_bundle(tiny_bundle, generator):
    """SpeculativeGenerator drives RunnerEngine exactly as it drives OnnxEngine (greedy output identical)."""
    from runtime.api import SpeculativeGenerator
    from runtime.trtllm.engine import RunnerEngine
    from test_engine_contract import CpuRunner

    manifest = load_manifest(tiny_bundle, verify=False)
    engines = {}
    for entry in (manifest.target, manifest.draft):
        base = _onnx_engine(tiny_bundle, manifest, entry, generator.target.vocab_size)
        engines[entry.role] = RunnerEngine(
            CpuRunner(base), vocab_size=base.vocab_size, max_context=manifest.max_context, end_id=2, pad_id=0
        )
    adapted = SpeculativeGenerator(
        manifest, engines["target"], engines["draft"], generator.tokenizer, manifest.eos_token_ids
    )
    prompts = ["The quick brown fox", "def add(a, b):"]
    want = generator.generate(prompts, max_new_tokens=12)
    got = adapted.generate(prompts, max_new_tokens=12)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


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


def test_external_draft_generator_is_the_target_greedy_output(tiny_bundle, generator):
    from runtime.trtllm.engine import ExternalDraftGenerator

    manifest = load_manifest(tiny_bundle, verify=False)
    engines = {
        entry.role: _onnx_engine(tiny_bundle, manifest, entry, generator.target.vocab_size)
        for entry in (manifest.target, manifest.draft)
    }
    spec = ExternalDraftGenerator(
        manifest,
        GreedyExecutor(engines["target"]),
        GreedyExecutor(engines["draft"]),
        generator.tokenizer,
        manifest.eos_token_ids,
    )
    prompts = ["The quick brown fox", "def add(a, b):"]
    want = generator.generate(prompts, max_new_tokens=12, mode="target")
    got = spec.generate(prompts, max_new_tokens=12, k=3)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert all(g.stats.num_draft_tokens > 0 and g.stats.num_accepted_tokens <= g.stats.num_draft_tokens for g in got)
    alone = spec.generate(prompts[0], max_new_tokens=12, mode="target")
    assert alone.token_ids == want[0].token_ids and alone.stats.num_draft_tokens == 0


def test_external_draft_generator_refuses_sampling_with_the_reason(tiny_bundle):
    from runtime.errors import RequestError
    from runtime.trtllm.engine import ExternalDraftGenerator

    manifest = load_manifest(tiny_bundle, verify=False)
    spec = ExternalDraftGenerator(manifest, None, None, None)
    with pytest.raises(RequestError, match="greedily in-process"):
        spec.generate("hi", temperature=0.7)


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
