"""ONNX Runtime on CUDA: fp16/int4 engines built with --device cuda, and provider selection.

No GPU here: the builds, the graphs' types, the numerics (the fp16 engines run on the CPU through ONNX Runtime's
inserted casts), the IO-binding path the GPU uses (bound to the CPU) and the provider errors are tested on any
machine. scripts/gpu_check.sh runs the same bundles on CUDAExecutionProvider; the last test here does too where
onnxruntime-gpu is installed.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime
import pytest
from click.testing import CliRunner

from runtime.bundle import BuildSpec, SpecError, load_manifest
from runtime.engines.onnx import OnnxEngine
from runtime.engines.sessions import DeviceError, providers_for

PROMPTS = ["def add(a, b):", "The quick brown fox", "Ünïcödé café"]
HAS_CUDA = "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def engine_of(bundle, role="target", **options):
    manifest = load_manifest(bundle, verify=False)
    entry = getattr(manifest, role)
    return OnnxEngine(
        bundle / entry.engine,
        num_layers=entry.num_layers,
        num_kv_heads=entry.num_kv_heads,
        head_dim=entry.head_dim,
        vocab_size=entry.vocab_size,
        max_context=manifest.max_context,
        threads=1,
        **options,
    )


def float_types(path):
    model = onnx.load(str(path))
    return {
        onnx.TensorProto.DataType.Name(w.data_type)
        for w in model.graph.initializer
        if w.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    }, model


def test_cuda_bundle_has_fp16_target_and_int4_draft(tiny_cuda_bundle):
    manifest = load_manifest(tiny_cuda_bundle)
    assert (manifest.spec.device, manifest.target.quant, manifest.draft.quant) == ("cuda", "fp16", "int4")
    types, target = float_types(tiny_cuda_bundle / manifest.target.engine)
    assert "FLOAT16" in types
    big_fp32 = [
        w.name for w in target.graph.initializer if w.data_type == onnx.TensorProto.FLOAT and int(np.prod(w.dims)) > 64
    ]
    assert not big_fp32, f"weights left in fp32: {big_fp32[:5]}"
    io = {i.name: i.type.tensor_type.elem_type for i in [*target.graph.input, *target.graph.output]}
    assert io["past.0.key"] == io["present.0.value"] == io["logits"] == onnx.TensorProto.FLOAT16
    _, draft = float_types(tiny_cuda_bundle / manifest.draft.engine)
    nbits = [n for n in draft.graph.node if n.op_type == "MatMulNBits"]
    assert nbits and all(next(a.i for a in n.attribute if a.name == "bits") == 4 for n in nbits)
    scales = {w.name: w.data_type for w in draft.graph.initializer}
    assert all(scales[n.input[2]] == onnx.TensorProto.FLOAT16 for n in nbits)  # fp16 activations and scales


def test_fp16_export_keeps_rotary_angles_in_fp32(tiny_cuda_bundle):
    """Positions x frequencies in fp16 would be off by up to a radian past position 2048 (fp16 spacing is 2)."""
    manifest = load_manifest(tiny_cuda_bundle, verify=False)
    model = onnx.load(str(tiny_cuda_bundle / manifest.target.engine))
    typed = {v.name: v.type.tensor_type.elem_type for v in model.graph.value_info}
    producers = {o: n for n in model.graph.node for o in n.output}
    cos = [n for n in model.graph.node if n.op_type == "Cos"]
    assert cos
    for node in cos:
        angle = node.input[0]
        while angle not in typed and angle in producers and producers[angle].op_type in ("Concat", "Transpose"):
            angle = producers[angle].input[0]
        assert typed[angle] == onnx.TensorProto.FLOAT, angle


def test_fp16_engine_agrees_with_the_fp32_engine(tiny_export_bundle, tiny_cuda_bundle):
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 300, (2, 40)).astype(np.int64)
    full = engine_of(tiny_export_bundle)
    half = engine_of(tiny_cuda_bundle)
    want = full.forward(full.new_cache(2), ids)
    got = half.forward(half.new_cache(2), ids)
    assert got.dtype == np.float32  # the sampler always sees fp32 logits
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max() + 1e-3


def test_cuda_bundle_greedy_equals_target_only_on_cpu(tiny_cuda_bundle):
    from runtime.api import SpeculativeGenerator

    generator = SpeculativeGenerator.from_bundle(tiny_cuda_bundle, threads=1, device="cpu")
    for prompt in PROMPTS:
        fast = generator.generate(prompt, max_new_tokens=24, k=3, plan=False)  # drafts every step
        slow = generator.generate(prompt, max_new_tokens=24, mode="target")
        assert fast.token_ids == slow.token_ids
        assert fast.stats.num_draft_tokens > 0


@pytest.mark.parametrize("bundle", ["tiny_export_bundle", "tiny_cuda_bundle"])
def test_io_binding_path_equals_the_plain_path(bundle, request):
    """The GPU keeps the cache on the device through an IO binding; bound to the CPU, the same code must give the
    same logits as the plain run, through prefill, decode, rollback and select."""
    path = request.getfixturevalue(bundle)
    plain, bound = engine_of(path), engine_of(path, cache_device="cpu")
    rng = np.random.default_rng(1)
    steps = [rng.integers(3, 300, (2, n)).astype(np.int64) for n in (6, 1, 4)]
    caches = [plain.new_cache(2), bound.new_cache(2)]
    for i, ids in enumerate(steps):
        outs = [e.forward(c, ids) for e, c in zip((plain, bound), caches)]
        np.testing.assert_array_equal(outs[0], outs[1])
        if i == 1:
            for e, c in zip((plain, bound), caches):
                e.rollback(c, np.array([6, 5]))
    picked = [e.select(c, np.array([1])) for e, c in zip((plain, bound), caches)]
    nxt = rng.integers(3, 300, (1, 2)).astype(np.int64)
    np.testing.assert_array_equal(plain.forward(picked[0], nxt), bound.forward(picked[1], nxt))


def test_providers_for_each_device():
    everything = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert providers_for("cpu", ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert providers_for("cuda", everything, device_id=1) == [
        ("CUDAExecutionProvider", {"device_id": 1}),
        "CPUExecutionProvider",
    ]
    assert [p if isinstance(p, str) else p[0] for p in providers_for("tensorrt", everything)] == everything
    with pytest.raises(DeviceError, match="onnxruntime-gpu"):
        providers_for("cuda", ["CPUExecutionProvider"])
    with pytest.raises(DeviceError, match="TensorrtExecutionProvider"):
        providers_for("tensorrt", ["CUDAExecutionProvider", "CPUExecutionProvider"])
    with pytest.raises(DeviceError, match="one of"):
        providers_for("tpu", everything)


@pytest.mark.skipif(HAS_CUDA, reason="this onnxruntime has CUDAExecutionProvider")
def test_cuda_bundle_without_a_gpu_provider_fails_early_and_says_what_to_do(tiny_cuda_bundle):
    from runtime.api import SpeculativeGenerator
    from runtime.cli import main

    with pytest.raises(DeviceError, match="pip install onnxruntime-gpu"):
        SpeculativeGenerator.from_bundle(tiny_cuda_bundle)
    result = CliRunner().invoke(main, ["generate", str(tiny_cuda_bundle), "hi", "--max-new-tokens", "2"])
    assert result.exit_code == 1 and "device 'cpu'" in result.output
    result = CliRunner().invoke(
        main, ["generate", str(tiny_cuda_bundle), "hi", "--max-new-tokens", "4", "--device", "cpu", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["identical_to_target"] is True


@pytest.mark.parametrize("device, quant", [("cpu", "fp16"), ("cuda", "fp32")])
def test_quant_must_suit_the_device(device, quant):
    with pytest.raises(SpecError, match=f"on device {device}"):
        BuildSpec(target="t", target_quant=quant, device=device)
    with pytest.raises(SpecError, match=f"on device {device}"):
        BuildSpec(target="t", target_quant="int4", draft_quant=quant, device=device)


def test_cli_device_cuda_defaults_to_an_fp16_target():
    from builder.cli import _device_defaults, spec_from

    spec, _ = spec_from({}, _device_defaults({}, {"target": "t", "device": "cuda"}))
    assert (spec.device, spec.target_quant, spec.draft_quant) == ("cuda", "fp16", "int4")
    spec, _ = spec_from({}, _device_defaults({}, {"target": "t", "device": "cuda", "target_quant": "int8"}))
    assert spec.target_quant == "int8"
    spec, _ = spec_from({}, _device_defaults({}, {"target": "t"}))
    assert (spec.device, spec.target_quant) == ("cpu", "fp32")


def test_triton_repository_of_a_cuda_bundle_places_instances_on_gpus(tiny_cuda_bundle, tiny_bundle, tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from triton_repo.generate import write_repository

    kinds = {}
    for name, bundle in (("cuda", tiny_cuda_bundle), ("cpu", tiny_bundle)):
        repo = tmp_path / name
        write_repository(bundle, repo)
        config = text_format.Parse((repo / "speculative" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        kinds[name] = model_config_pb2.ModelInstanceGroup.Kind.Name(config.instance_group[0].kind)
    assert kinds == {"cuda": "KIND_GPU", "cpu": "KIND_CPU"}


@pytest.mark.skipif(
    not HAS_CUDA, reason="needs onnxruntime-gpu with CUDAExecutionProvider and a GPU (scripts/gpu_check.sh)"
)
def test_cuda_bundle_on_the_gpu_greedy_equals_target_only(tiny_cuda_bundle):
    from runtime.api import SpeculativeGenerator

    generator = SpeculativeGenerator.from_bundle(tiny_cuda_bundle, device="cuda")
    for prompt in PROMPTS:
        fast = generator.generate(prompt, max_new_tokens=24, k=3)
        slow = generator.generate(prompt, max_new_tokens=24, mode="target")
        assert fast.token_ids == slow.token_ids
