"""Stage 3: export a decoder to one ONNX graph that serves prefill, one-token decode and the (k+1)-token verify pass.

The graph's contract (the runtime's OnnxEngine relies on it)::

    inputs   input_ids      int64 [B, S]        S >= 1 new tokens
             attention_mask int64 [B, P + S]    1 = this cache slot holds a live token, 0 = padding or rolled back
             position_ids   int64 [B, S]        rotary position of each new token
             past.{i}.key / past.{i}.value  float32 [B, H_kv, P, D]   P >= 0 (float16 in a CUDA graph)
    outputs  logits         float32 [B, S, V] (float16 in a CUDA graph)
             present.{i}.key / present.{i}.value [B, H_kv, P + S, D]  (past with the new slots appended)

Rolling back never slices the cache: the runtime marks rejected slots 0 in ``attention_mask``, and the graph builds
its 4-D causal mask from that itself, which is also how left-padded batches work. This is the graph for CUDA engines
and for models the fused CPU graph (builder/graph.py, the CPU default) does not cover: torch's decoder op by op
(~86 nodes a layer, the whole cache concatenated on each call), checked against torch below.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


class ExportError(RuntimeError):
    """The exported graph disagrees with torch, or the exporter failed."""


@dataclass(frozen=True)
class GraphInfo:
    """What the runtime must know of an engine graph (ModelEntry's fields); ``graph``: its contract (bundle.GRAPHS)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    graph: str = "export"
    notes: tuple[str, ...] = ()  # what the graph's build wants the report to say about it (e.g. longrope's switch)


def cache_names(num_layers: int, prefix: str) -> list[str]:
    return [f"{prefix}.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]


def graph_info(config) -> GraphInfo:
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return GraphInfo(
        num_layers=layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        input_names=("input_ids", "attention_mask", "position_ids", *cache_names(layers, "past")),
        output_names=("logits", *cache_names(layers, "present")),
    )


class _CachedDecoder(torch.nn.Module):
    """Flat-tensor wrapper: (ids, slot mask, positions, *past) -> (logits, *present)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.num_layers = model.config.num_hidden_layers

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        past_len, new_len = past[0].shape[2], input_ids.shape[1]
        slot = torch.arange(past_len + new_len).view(1, 1, 1, -1)
        query = (torch.arange(new_len) + past_len).view(1, 1, -1, 1)
        # A query sees live slots at or before its own; it always sees itself, so padded rows stay finite.
        allowed = (attention_mask.bool()[:, None, None, :] & (slot <= query)) | (slot == query)
        allowed = self._windowed(allowed, attention_mask, position_ids)
        cache = DynamicCache()
        for i in range(self.num_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(
            input_ids=input_ids, attention_mask=allowed, position_ids=position_ids, cache=cache, use_cache=True
        )
        present = []
        for layer in out.cache.layers[: self.num_layers]:
            present += [layer.keys, layer.values]
        return (out.logits, *present)

    def _windowed(self, allowed, attention_mask, position_ids):
        """A 4-D mask is used as it is, so a sliding window must be in it: a query at position p sees live slots at
        positions > p - window (transformers' sliding_window_overlay), a slot's position being the number of live
        slots before it. Models with layer_types take one mask per layer type (Gemma 2/3, Qwen2/3)."""
        config = self.model.config
        window = int(getattr(config, "sliding_window", None) or 0)
        types = getattr(config, "layer_types", None)
        if not window or not getattr(config, "use_sliding_window", True):
            return self._for_kernel(allowed)
        slot_position = (torch.cumsum(attention_mask, -1) - 1)[:, None, None, :]
        sliding = allowed & ((position_ids[:, None, :, None] - slot_position) < window)
        if types is None:
            return self._for_kernel(sliding)
        return {"full_attention": self._for_kernel(allowed), "sliding_attention": self._for_kernel(sliding)}

    def _for_kernel(self, allowed):
        """Eager attention (Gemma 2: softcaps) adds the mask to the scores: a boolean one must become additive."""
        if self.model.config._attn_implementation != "eager":
            return allowed
        dtype = self.model.get_input_embeddings().weight.dtype  # float16 in a CUDA export
        return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def _example(info: GraphInfo, batch=2, past=3, new=4, dtype=torch.float32):
    ids = torch.randint(0, min(info.vocab_size, 100), (batch, new))
    mask = torch.ones(batch, past + new, dtype=torch.int64)
    pos = torch.arange(past, past + new).repeat(batch, 1)
    cache = [
        torch.randn(batch, info.num_kv_heads, past, info.head_dim, dtype=dtype) for _ in range(2 * info.num_layers)
    ]
    return ids, mask, pos, cache


GRAPH_DTYPES = {"cpu": "float32", "cuda": "float16"}  # the export's float type per target device


def export_decoder(model, out_path: Path, opset: int = 18, dtype: str = "float32") -> GraphInfo:
    """Export ``model`` (a transformers causal LM in eval mode, fp32) to ``out_path``.

    ``dtype="float16"`` (CUDA engines) exports a half-precision copy of the model, leaving ``model`` untouched:
    transformers keeps the rotary angles and RMSNorm statistics in fp32 inside an fp16 model, and the exporter
    records exactly that, whereas converting a finished fp32 graph to fp16 would round positions x frequencies
    (an angle error of up to a radian at position 3000).
    """
    from torch.export import Dim

    if dtype not in ("float32", "float16"):
        raise ExportError(f"export dtype must be float32 or float16, received {dtype!r}")
    if dtype == "float16":
        import copy

        model = copy.deepcopy(model).to(torch.float16)
    info = graph_info(model.config)
    head = model.get_output_embeddings()
    if head is not None and head.weight.shape[0] != info.vocab_size:  # a reduced-vocabulary draft head (distill)
        info = dataclasses.replace(info, vocab_size=int(head.weight.shape[0]))
    ids, mask, pos, cache = _example(info, dtype=getattr(torch, dtype))
    batch, new, total, past = Dim.DYNAMIC, Dim.DYNAMIC, Dim.DYNAMIC, Dim.DYNAMIC
    shapes = {
        "input_ids": {0: batch, 1: new},
        "attention_mask": {0: batch, 1: total},
        "position_ids": {0: batch, 1: new},
        "past": tuple({0: batch, 2: past} for _ in cache),
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with torch.no_grad():
            program = torch.onnx.export(
                _CachedDecoder(model).eval(),
                (ids, mask, pos, *cache),
                dynamo=True,
                dynamic_shapes=shapes,
                input_names=list(info.input_names),
                output_names=list(info.output_names),
                opset_version=opset,
                verbose=False,
            )
        program.save(str(out_path), external_data=_needs_external_data(model))
    except OSError:
        raise  # disk full and friends: the pipeline turns them into actionable errors
    except Exception as err:  # the exporter raises many types; name the stage and keep the cause
        raise ExportError(f"ONNX export failed: {type(err).__name__}: {err}") from err
    fold_weight_transposes(out_path)
    fuse_for_onnxruntime(out_path)
    return info


def fuse_for_onnxruntime(path: Path) -> dict[str, int]:
    """Fuse RMSNorm (and the residual add before it) into ONNX Runtime's contrib ops; returns fusion counts.

    Why: the exported graph has ~86 small nodes per layer, and on a CPU a small draft's decode step is dominated by
    per-node overhead, not by reading weights; this removes ~12% of the nodes and measurably cuts the step time.
    (onnxscript's rotary fusion needs a cos/sin-cache pattern this graph does not have, so it is not attempted.)
    Attention itself is left unfused: ORT's GroupQueryAttention would ignore the slot mask that rollback and
    padded batches rely on. check_against_torch runs on the fused graph, so a wrong fusion fails the build.
    """
    import onnxscript
    from onnxscript import ir
    from onnxscript.rewriter.ort_fusions.rms_normalization import fuse_rms_normalization
    from onnxscript.rewriter.ort_fusions.skip_normalization import fuse_skip_rms_normalization

    model = ir.load(str(path))
    onnxscript.optimizer.optimize(model)
    counts = {fuse.__name__[5:]: fuse(model) for fuse in (fuse_rms_normalization, fuse_skip_rms_normalization)}
    onnxscript.optimizer.optimize(model)
    _strip_build_metadata(model)
    weights = (v.const_value for v in model.graph.initializers.values() if v.const_value is not None)
    large = sum(w.nbytes for w in weights) > 1_800_000_000
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)
    ir.save(model, str(path), external_data=data.name if large else None)
    return counts


def _strip_build_metadata(model) -> None:
    """Drop the exporter's per-node stack traces: they carry absolute paths of the build machine into the bundle."""
    for node in model.graph.all_nodes():
        node.metadata_props.clear()
        node.doc_string = None
    for holder in (model, model.graph):
        holder.metadata_props.clear()
        holder.doc_string = None


def fold_weight_transposes(path: Path) -> int:
    """Store Transpose(weight) as a transposed weight. Returns how many were folded.

    The exporter writes a tied output head as MatMul(h, Transpose(embedding)); ONNX Runtime's weight quantizer only
    quantizes a MatMul whose weight is a constant, so without this fold the head (a fifth of SmolLM2's weights)
    stays fp32 in an int4 engine.
    """
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    weights = {w.name: w for w in model.graph.initializer}
    folded = 0
    for node in list(model.graph.node):
        if node.op_type != "Transpose" or node.input[0] not in weights:
            continue
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        array = numpy_helper.to_array(weights[node.input[0]])
        model.graph.initializer.append(
            numpy_helper.from_array(np.ascontiguousarray(array.transpose(perm)), node.output[0])
        )
        model.graph.node.remove(node)
        folded += 1
    used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    kept = [w for w in model.graph.initializer if w.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    large = sum(w.ByteSize() for w in kept) > 1_800_000_000
    onnx.save(model, str(path), save_as_external_data=large, location=path.name + ".data" if large else None)
    return folded


def _needs_external_data(model) -> bool:
    return sum(p.numel() * p.element_size() for p in model.parameters()) > 1_800_000_000


FP16_RELATIVE_TOLERANCE = 2e-2  # an fp16 graph vs the fp32 model: |Δlogit| up to this share of the largest logit


def compare_cases(cases: dict, tolerance: float, vocab: int, fp16: bool = False) -> dict:
    """Max |logit difference| per case {name: (graph logits, torch logits)}; raises ExportError past the tolerance,
    or where the argmax differs although torch's two best logits are further apart than the tolerance."""
    report = {}
    for name, (got, want) in cases.items():
        got, want = got[:, :vocab].astype(np.float32), want[:, :vocab]
        allowed = tolerance
        if fp16:
            allowed = max(tolerance, FP16_RELATIVE_TOLERANCE * float(np.abs(want).max()))
        diff = float(np.abs(got - want).max())
        report[name] = diff
        top2 = np.sort(want, axis=-1)[:, -2:]
        decided = (top2[:, 1] - top2[:, 0]) > allowed  # positions whose argmax no rounding may change
        flipped = (got.argmax(-1) != want.argmax(-1)) & decided
        if diff > allowed or flipped.any():
            raise ExportError(
                f"exported graph disagrees with torch on {name}: max |Δlogit| {diff:.2e} "
                f"(tolerance {allowed:.1e}), {int(flipped.sum())} clear argmax changes; refusing "
                "to build a wrong engine"
            )
    return report


def check_against_torch(model, onnx_path: Path, info: GraphInfo, tolerance: float, seed: int = 0) -> dict:
    """Compare the graph with torch (fp32) on prefill, a verify pass over rolled-back slots, and a left-padded batch.

    Returns the max |logit difference| per case; raises ExportError past the tolerance, or where the argmax differs
    although torch's two best logits are further apart than the tolerance. An fp16 graph (CUDA engines; run here on
    the CPU through ONNX Runtime's inserted casts) gets ``FP16_RELATIVE_TOLERANCE`` of the largest logit.
    """
    from runtime.engines.sessions import make_session

    session = make_session(onnx_path, threads=0)
    dtype = np.float16 if "float16" in session.get_inputs()[3].type else np.float32
    rng = np.random.default_rng(seed)
    vocab = min(info.vocab_size, int(model.config.vocab_size))
    seq = rng.integers(0, vocab, (1, 12))
    with torch.no_grad():
        reference = model(torch.from_numpy(seq)).logits.numpy()

    def run(ids, mask, pos, past):
        feed = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
        feed.update(zip(info.input_names[3:], past))
        out = session.run(list(info.output_names), feed)
        return out[0], out[1:]

    empty = [np.zeros((1, info.num_kv_heads, 0, info.head_dim), dtype)] * (2 * info.num_layers)
    prefill, past = run(seq[:, :5], np.ones((1, 5), np.int64), np.arange(5)[None], empty)
    # three slots of junk, then rolled back by the mask: the verify pass must not see them
    _, junk = run(rng.integers(0, vocab, (1, 3)), np.ones((1, 8), np.int64), np.arange(5, 8)[None], past)
    mask = np.ones((1, 15), np.int64)
    mask[0, 5:8] = 0
    verify, _ = run(seq[:, 5:], mask, np.arange(5, 12)[None], junk)
    lengths = (7, 12)
    ids = np.zeros((2, 12), np.int64)
    pad_mask = np.zeros((2, 12), np.int64)
    positions = np.zeros((2, 12), np.int64)
    for row, n in enumerate(lengths):
        ids[row, 12 - n :], pad_mask[row, 12 - n :], positions[row, 12 - n :] = seq[0, :n], 1, np.arange(n)
    batch_empty = [np.zeros((2, info.num_kv_heads, 0, info.head_dim), dtype)] * (2 * info.num_layers)
    batched, _ = run(ids, pad_mask, positions, batch_empty)
    cases = {
        "prefill": (prefill[0], reference[0, :5]),
        "verify_after_rollback": (verify[0], reference[0, 5:]),
        "left_padded_batch": (batched[0, 5:], reference[0, :7]),
    }
    report = compare_cases(cases, tolerance, vocab, fp16=dtype == np.float16)
    return report
