"""A GGUF draft's forms (builder/gguf/draft_form.py): re-quantized into Q4_0 it is byte for byte the engine of a file
that gguf's own quantizer wrote from the same values; a reduced head is the file's rows for the kept ids, mapped
back exactly; the kept ids come from the tokenizer and the builder's text; a spec that asks for a form the build
cannot make is refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from builder import graph, head_vocab
from builder.decoder import from_transformers
from builder.gguf import draft_form
from builder.gguf import weights as gguf_weights
from builder.gguf.header import open_gguf
from builder.gguf.draft_form import DraftForm
from conftest import make_model, tiny_config
from runtime.bundle import BuildSpec, SpecError
from runtime.engines import gguf_ops
from test_gguf_types import _dequantize, _engine, _kind, _write_gguf

native_only = pytest.mark.skipif(not gguf_ops.available(), reason=f"{gguf_ops.unavailable_reason()}")
# Qwen2.5-Coder-0.5B's Q4_K_M file where its 896-wide rows fall back to 32-wide types
SMALL_ROWS = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q5_0"} | {
    "ffn_gate": "Q5_0",
    "ffn_up": "Q5_0",
    "ffn_down": "Q8_0",
    "token_embd": "Q8_0",
}


def _model_and_file(tmp_path, types=SMALL_ROWS):
    model = make_model(tmp_path / "m", tiny_config(), seed=3).eval()
    _write_gguf(model, tmp_path / "m.gguf", types)
    return model, tmp_path / "m.gguf"


def _requantized_copy(src, dst, kind: str = "Q4_0") -> None:
    """``src`` with every quantized tensor re-quantized to ``kind`` by the gguf package itself (its quantizer over
    its dequantization of the file's blocks), written as a GGUF file: the oracle of a re-quantized draft."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), "llama")
    for tensor in reader.tensors:
        k, n = (int(d) for d in tensor.shape)
        values = _dequantize(np.asarray(tensor.data), tensor.tensor_type.name, (n, k))
        raw = gguf.quants.quantize(values.astype(np.float32), _kind(kind))
        writer.add_tensor(tensor.name, raw, raw_dtype=_kind(kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _parts(decoder):
    linears = [lin for layer in decoder.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return [(kind, data) for lin in [*linears, decoder.head] for kind, data in lin.gguf.parts]


@native_only
def test_a_requantized_draft_is_the_engine_of_the_file_ggufs_quantizer_writes(tmp_path):
    model, path = _model_and_file(tmp_path)
    _requantized_copy(path, tmp_path / "q4_0.gguf")
    made = gguf_weights.apply(from_transformers(model), open_gguf(path), native=True, form=DraftForm("q4_0"))
    oracle = _oracle_decoder(tmp_path / "q4_0.gguf", model)  # (the model now holds the Q4_0 file's values)
    assert all(kind == "Q4_0" for kind, _ in _parts(made)) and made.embedding_gguf.parts[0][0] == "Q4_0"
    for (kind, data), (want_kind, want) in zip(_parts(made), _parts(oracle), strict=True):
        assert kind == want_kind and np.array_equal(data, want)
    assert np.array_equal(made.embedding_gguf.parts[0][1], oracle.embedding_gguf.parts[0][1])
    assert "Q4_0" not in SMALL_ROWS.values()  # every block really was re-quantized


def _oracle_decoder(q4_path, model):
    """The exact (file-blocks) path over the Q4_0 file, its float weights set to that file's values so its own
    consistency check passes."""
    import torch

    from test_gguf_types import STEMS, _unpermute

    import gguf

    values = {}
    for tensor in gguf.GGUFReader(str(q4_path)).tensors:
        k, n = (int(d) for d in tensor.shape)
        values[tensor.name] = _dequantize(np.asarray(tensor.data), "Q4_0", (n, k))
    config = model.config
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for module_name, stem in STEMS.items():
                module = getattr(layer.self_attn, module_name, None) or getattr(layer.mlp, module_name)
                w = values[f"blk.{i}.{stem}.weight"]
                heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(stem)
                module.weight.copy_(torch.from_numpy(_unpermute(w, heads) if heads else w))
        model.model.embed_tokens.weight.copy_(torch.from_numpy(values["token_embd.weight"]))
    return gguf_weights.apply(from_transformers(model), open_gguf(q4_path), native=True)


@pytest.mark.parametrize("native", [pytest.param(True, marks=native_only), False], ids=["kernel", "matmulnbits"])
def test_a_reduced_head_is_the_files_rows_for_the_kept_ids(tmp_path, native):
    model, path = _model_and_file(tmp_path)
    ids = np.array([0, 2, 5, 17, 31, 64, 100, 200, 255, 319] + list(range(32, 54)))
    ids = np.unique(ids)
    full = gguf_weights.apply(from_transformers(model), open_gguf(path), native=native)
    cut = gguf_weights.apply(from_transformers(model), open_gguf(path), native=native, form=DraftForm("file", ids))
    assert cut.vocab == len(ids) and full.vocab == 320
    if native:  # the tied file's table is still whole for the embedding, no longer shared with the head
        assert cut.embedding_gguf is not cut.head.gguf and len(cut.embedding_gguf.parts[0][1]) == 320
    graph.build(full, tmp_path / "full.onnx")
    graph.build(cut, tmp_path / "cut.onnx")
    tokens = np.random.default_rng(1).integers(0, 320, (2, 9))
    logits = [(_engine(tmp_path / f"{n}.onnx", d).forward(_engine(tmp_path / f"{n}.onnx", d).new_cache(2), tokens))
              for n, d in (("full", full), ("cut", cut))]  # fmt: skip
    assert logits[1].shape == (2, 9, len(ids))
    assert np.allclose(logits[1], logits[0][..., ids], rtol=1e-5, atol=1e-5 * np.abs(logits[0]).max())


def test_requantized_blocks_are_checked_against_the_values_they_came_from():
    rng = np.random.default_rng(0)
    values = rng.standard_normal((48, 96)).astype(np.float32)
    raw = draft_form.requantized(values, "Q4_0")
    assert raw.shape == (48, 3 * 18)
    draft_form.check_requantized("w", raw, "Q4_0", values)  # within a step of every value
    with pytest.raises(ValueError, match="w: re-quantized to Q4_0"):
        draft_form.check_requantized("w", raw, "Q4_0", values[::-1].copy())  # blocks of other rows


class _Tokenizer:
    """What frequent_ids reads of a tokenizer: specials, added tokens, and ids of a text."""

    all_special_ids = [900]
    added_tokens_decoder = {901: "<|im_end|>", 902: "<|im_start|>"}

    def __call__(self, text):
        return {"input_ids": [500 + (ord(c) % 50) for c in text[:2000]]}


def test_the_kept_ids_hold_specials_then_the_texts_tokens_then_the_lowest_ids():
    kept = head_vocab.frequent_ids(_Tokenizer(), 200, 1000, always=[999])
    assert len(kept) == 200 and len(set(kept)) == 200 and np.all(np.diff(kept) > 0)
    assert {999, 900, 901, 902} <= set(kept)
    text_ids = set(_Tokenizer()(open_prompts())["input_ids"])
    assert text_ids <= set(kept)  # every token of the builder's prompt text (fewer than 50 distinct here)
    fill = sorted(set(kept) - text_ids - {999, 900, 901, 902})
    assert fill == list(range(len(fill)))  # the rest by id: merge order
    with pytest.raises(ValueError, match="rows"):
        head_vocab.frequent_ids(_Tokenizer(), 1000, 1000)


def open_prompts() -> str:
    from importlib import resources

    return resources.files("builder").joinpath(head_vocab.PROMPT_TEXT).read_text(encoding="utf-8")


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"draft_quant": "int8", "draft_blocks": "q4_0"}, "draft_quant"),
        ({"draft_quant": "int4", "draft_blocks": "q4_0", "target_quant": "int8"}, "draft_quant"),  # no gguf target
        ({"draft_quant": "int4", "draft_head": 4096}, "draft_quant"),
        ({"draft_quant": "gguf", "draft_blocks": "q2_k"}, "draft_blocks"),
        ({"draft_quant": "gguf", "draft_head": 100}, "draft_head"),
        ({"draft_quant": "gguf", "draft_head": -1}, "draft_head"),
    ],
)
def test_a_form_the_build_cannot_make_is_refused_by_name(fields, field):
    with pytest.raises(SpecError, match=field):
        BuildSpec(target="t.gguf", draft="d.gguf", **{"target_quant": "gguf", **fields})
