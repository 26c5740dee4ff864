"""Stage 3: each role's model made into its fp32 graph, checked against torch, and handed to stage 4
(builder.quantize) for its engine file.

The model surgery lives here: what a role's graphs are made from (``Model``: a GGUF file read layer by layer, or the
transformers model loaded whole), a self-draft cut to the target's first layers (``truncate``) and a draft's head cut
to a reduced vocabulary (``reduce_head``). So does the order in which memory is taken and given back: where the
roles' weights differ only one model is held at a time (``make_engines``). The graphs are written from data: a
Decoder and its reference model are made first, then builder.graph (or builder.export) writes and checks them; a
feature draft's graph is its own module's (builder.distill.feature_draft.export_feature_draft).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from builder import export, graph, memory, quantize
from builder.decoder import GraphError, from_transformers
from builder.errors import BuildError
from builder.gguf import stream as gguf_stream
from builder.gguf import float_draft
from builder.gguf.draft_form import KERNEL_BLOCKS, DraftForm
from builder.progress import Stage
from runtime.bundle import BuildSpec


def memory_needed(spec: BuildSpec, target_ckpt, draft_ckpt) -> memory.Estimate:
    """The build's estimated peak (builder.memory): a self-draft shares the target's weights."""
    separate = draft_ckpt is not target_ckpt and not is_feature_draft(draft_ckpt)
    streamed = all(
        gguf_stream.supported(c, spec.engine_graph) for c in ((target_ckpt, draft_ckpt) if separate else (target_ckpt,))
    )
    return memory.estimate(target_ckpt.config, draft_ckpt.config if separate else None, streamed)


def is_feature_draft(checkpoint) -> bool:
    """Whether ``checkpoint`` is a feature draft (``draftsmith distill --init feature``): it drafts from the target's
    hidden states, so it is neither loaded as a model of its own nor paired with another tokenizer."""
    from builder.distill import feature_draft

    return not checkpoint.gguf_file and feature_draft.is_feature_draft(checkpoint.folder)


@dataclasses.dataclass(frozen=True)
class Engine:
    """One role's engine as exported: its fp32 graph's info and export check, the fp32 graph the quantizer reads,
    and the graph its quantized form is scored against."""

    info: object  # the graph's GraphInfo
    check: object  # the export check against torch (max |logit difference|, or its report)
    fp32: Path
    reference: Path


def make_engines(
    tmp: Path,
    work: Path,
    spec: BuildSpec,
    target_ckpt,
    draft_ckpt,
    draft_layers: int,
    kept,
    rows: int,
    stage: Stage,
    chooser=None,
) -> tuple[Engine, Engine, dict[str, list[str]], BuildSpec, object]:
    """(target, draft, each role's engine notes, the spec and kept ids the draft was made with): both engines
    exported to fp32 in ``work`` and quantized into ``tmp``. Where the roles' weights differ only one model is held
    at a time: the target's go before a separate draft's load; a truncated self-draft reads the target's, a whole
    one quantizes the target's own fp32 graph. With a ``chooser`` (draft_blocks auto) the draft's form, drafter and
    k are measured once the target is made (``builder.draft_choice.Chooser``)."""
    spec = kernel_draft(spec, target_ckpt, draft_ckpt)
    target, target_model, target_notes = _make_target(
        tmp, work, spec, target_ckpt, draft_ckpt, draft_layers, rows, stage
    )
    if chooser is not None:
        target_model = None
        memory.release()
        stage("choose draft")
        spec, kept = chooser.choose(tmp, work, spec, target, draft_ckpt, rows)
    stage("export draft")
    if draft_ckpt is target_ckpt and not draft_layers:
        draft_model = target_model
        draft = dataclasses.replace(
            target, reference=target.reference if draft_quant(spec) == spec.target_quant else target.fp32
        )
    elif is_feature_draft(draft_ckpt):
        from builder.distill.feature_draft import export_feature_draft

        draft_model = None
        info, check, feature = export_feature_draft(
            target_model, target_ckpt, draft_ckpt, kept, work / "draft.onnx", spec.engine_graph
        )
        draft = Engine(info, check, work / "draft.onnx", work / "draft.onnx")
    else:
        if not draft_layers:
            target_model = None  # a separate draft: the target's weights are written; free them first
            memory.release()
        draft_model = target_model if draft_layers else Model(draft_ckpt, spec, rows, kept)
        fp32, reference = work / "draft.onnx", _reference_path(work, "draft", draft_model, draft_quant(spec), spec)
        info, check = _export(draft_model, draft_ckpt, fp32, spec, draft_layers, full=reference == fp32)
        if kept is not None and draft_model.streamed is not None:  # the head is cut as its blocks are written
            info = dataclasses.replace(info, vocab_size=len(kept))
        draft = Engine(info, check, fp32, reference)
    memory.release()
    stage("quantize draft")
    if is_feature_draft(draft_ckpt):
        spec, draft_notes = _feature_engine(feature, tmp / "draft" / "model.onnx", spec, draft.fp32, target_ckpt)
    else:
        draft_notes = quantize.quantize_engine(
            draft.fp32,
            tmp / "draft" / "model.onnx",
            draft_quant(spec),
            spec,
            target_ckpt if draft_layers else draft_ckpt,
            draft_model,
            draft_layers,
            reference=None if draft.reference == target.reference else draft.reference,
            form=DraftForm(spec.draft_blocks, kept),
        )
    notes = {
        role: list(dict.fromkeys([*engine.info.notes, *notes]))  # the fp32 graph's notes first
        for role, engine, notes in (("target", target, target_notes), ("draft", draft, draft_notes))
    }
    return target, draft, notes, spec, kept


def kernel_draft(spec: BuildSpec, target_ckpt, draft_ckpt) -> BuildSpec:
    """``spec`` with the draft's form on Draftsmith's kernel: a feature draft or a self-draft asked for as int4
    beside a gguf target whose kernel is built (``quantize.native_gguf``) is written as GgufMatMul over Q4_0 blocks
    (``draft_blocks: q4_0``, the form the manifest then records) instead of ONNX Runtime's MatMulNBits, which it
    stays where the kernel is not built. Refused (BuildError): int4 in Q4_0 blocks for any other draft."""
    ours = draft_ckpt is target_ckpt or is_feature_draft(draft_ckpt)
    int4_beside_gguf = spec.draft_quant == "int4" and spec.target_quant == "gguf"
    if int4_beside_gguf and spec.draft_blocks == KERNEL_BLOCKS and not ours:
        raise BuildError(
            f"draft_blocks {KERNEL_BLOCKS} with draft_quant int4 puts a feature draft or a self-draft on "
            f"Draftsmith's kernel; {draft_ckpt.source} is neither: use draft_blocks file (or a .gguf draft with "
            "draft_quant gguf)"
        )
    if int4_beside_gguf and ours and spec.draft_blocks == "file" and quantize.native_gguf(spec):
        return dataclasses.replace(spec, draft_blocks=KERNEL_BLOCKS)
    return spec


def draft_quant(spec: BuildSpec) -> str:
    """The quant the draft's engine is written with: an int4 self-draft on the kernel (``kernel_draft``) is the
    target file's values re-quantized into Q4_0 blocks, the GGUF path's (builder.gguf.weights, DraftForm q4_0)."""
    return "gguf" if spec.draft_quant == "int4" and spec.draft_blocks == KERNEL_BLOCKS else spec.draft_quant


def _feature_engine(decoder, dst: Path, spec: BuildSpec, fp32: Path, target_ckpt) -> tuple[BuildSpec, list[str]]:
    """(spec, notes) of a feature draft's engine at ``dst``: on Draftsmith's kernel (``kernel_draft``: every matrix
    Q4_0 blocks, the embedding the target file's own blocks, builder.gguf.float_draft.on_kernel), else ``fp32``
    quantized as ``spec.draft_quant`` by ONNX Runtime. A draft whose widths are not whole Q4_0 blocks keeps
    MatMulNBits, and the spec then says so (draft_blocks file)."""
    if spec.draft_blocks != KERNEL_BLOCKS:
        quantize.quantize(fp32, dst, spec.draft_quant, spec.block_size, spec.symmetric, spec.accuracy_level)
        return spec, []
    wrong = float_draft.fits_kernel(decoder)
    if wrong is not None:
        quantize.quantize(fp32, dst, spec.draft_quant, spec.block_size, spec.symmetric, spec.accuracy_level)
        return dataclasses.replace(spec, draft_blocks="file"), [
            f"ONNX Runtime's MatMulNBits int4, not Draftsmith's kernel: {wrong} is not whole Q4_0 blocks"
        ]
    try:
        float_draft.on_kernel(decoder, target_ckpt.gguf, target_ckpt.architecture.gguf_permuted_qk)
    except ValueError as err:
        raise BuildError(f"the feature draft on Draftsmith's kernel: {err}") from None
    graph.build(decoder, dst, spec.accuracy_level)
    table = decoder.embedding_gguf or decoder.embedding_quant
    how = "GgufGather" if decoder.embedding_gguf is not None else "GatherBlockQuantized"
    kind = decoder.embedding_gguf.parts[0][0] if decoder.embedding_gguf is not None else f"{table.bits}-bit"
    return spec, [
        "every matrix (fc, layer, head) re-quantized from the draft's float weights into Q4_0 blocks, multiplied "
        f"by Draftsmith's GgufMatMul; its embedding the target file's own {kind} blocks ({how})"
    ]


def _make_target(
    tmp: Path, work: Path, spec: BuildSpec, target_ckpt, draft_ckpt, draft_layers: int, rows: int, stage: Stage
):
    """(engine, model, the quantizer's notes) of the target, exported and quantized. Its fp32 graph is written whole
    only where something reads it: a whole self-draft quantized from it, or the target scored against it."""
    stage("export target")
    model = Model(target_ckpt, spec, rows)
    self_fp32 = draft_ckpt is target_ckpt and not draft_layers and draft_quant(spec) != "gguf"  # quantized from it
    fp32, reference = work / "target.onnx", _reference_path(work, "target", model, spec.target_quant, spec)
    info, check = _export(model, target_ckpt, fp32, spec, full=self_fp32 or reference == fp32)
    memory.release()  # the torch check's session and arrays
    stage("quantize target")
    notes = quantize.quantize_engine(
        fp32, tmp / "target" / "model.onnx", spec.target_quant, spec, target_ckpt, model, reference=reference
    )
    memory.release()
    return Engine(info, check, fp32, reference), model, notes


class Model:
    """What a role's graphs are made from: a GGUF file read layer by layer (builder.gguf.stream: memory follows one
    layer) where the fused graph is written, else the transformers model loaded whole."""

    def __init__(self, checkpoint, spec: BuildSpec, context: int, kept=None):
        self.checkpoint, self.context = checkpoint, context
        self.streamed = (
            gguf_stream.Streamed(checkpoint, context) if gguf_stream.supported(checkpoint, spec.engine_graph) else None
        )
        self.whole = None
        if self.streamed is None:
            self.whole = checkpoint.load_model()
            if kept is not None:  # a reduced-vocabulary draft head
                self.whole = reduce_head(self.whole, kept)

    def torch_model(self, layers: int = 0):
        """The transformers model of the first ``layers`` layers (0: all; streamed: at most its reference's)."""
        model = self.whole if self.streamed is None else self.streamed.reference
        return truncate(model, layers) if layers and layers < model.config.num_hidden_layers else model

    def decoder(self, layers: int = 0):
        """The fused graph's Decoder of the first ``layers`` layers (0: all)."""
        if self.streamed is not None:
            return self.streamed.decoder(layers or None)
        model = self.torch_model(layers)
        return from_transformers(model, self.context)

    def embedding_and_head(self) -> tuple[np.ndarray, np.ndarray]:
        """float32 [V, H] each (a feature draft reads the target's)."""
        model = self.torch_model()
        return (
            model.get_input_embeddings().weight.detach().float().numpy(),
            model.get_output_embeddings().weight.detach().float().numpy(),
        )


def _reference_path(work: Path, role: str, model: Model, quant: str, spec: BuildSpec) -> Path:
    """What the build report scores ``role``'s engine against. A GGUF file's own blocks (quant gguf, read layer by
    layer): the same blocks computed in fp32 (MatMulNBits at accuracy level 0 dequantizes each block to the float32
    weights the fp32 graph holds: max |logit difference| 6e-5 and the same argmax on a 512-token Qwen2.5-Coder-0.5B
    window), whose session holds the file's bytes, not 4 bytes a parameter (6.2 GB for a 1.5B model). Else the fp32
    graph."""
    if quant == "gguf" and model is not None and model.streamed is not None and spec.engine_graph == "fused":
        # accuracy level 0 in MatMulNBits' form: the engine is itself that reference
        itself = spec.accuracy_level == 0 and not quantize.native_gguf(spec)
        return work.parent / role / "model.onnx" if itself else work / f"{role}.reference.onnx"
    return work / f"{role}.onnx"


def _export(model: Model, checkpoint, path: Path, spec: BuildSpec, layers: int = 0, full: bool = True):
    """The fp32 (fp16 on cuda) graph of ``model``'s first ``layers`` layers (0: all) at ``path``, checked against
    torch: (GraphInfo, check report)."""
    tolerance = checkpoint.architecture.tolerance
    if spec.engine_graph == "fused":
        return _export_fused(model, checkpoint.source, path, tolerance, layers, full)
    whole = model.torch_model(layers)
    info = export.export_decoder(whole, path, spec.opset, export.GRAPH_DTYPES[spec.device])
    return info, export.check_against_torch(whole, path, info, tolerance)


def _export_fused(model: Model, source: str, path: Path, tolerance: float, layers: int, full: bool):
    """The fused graph of ``model``'s first ``layers`` layers, checked against its transformers model. A streamed
    GGUF model is checked on its reference's first layers, whose graph is written beside ``path`` by the same lazy
    path (builder.gguf.stream); ``full`` False writes only that (nothing reads the whole fp32 graph: the engine is the
    file's blocks and its reference the same blocks in fp32). Both decoders are made before any graph is written, and
    both graphs written before the one check: graph.py takes them as data."""
    try:
        decoder = model.decoder(layers)
        reference = model.torch_model(layers)
        checked = reference.config.num_hidden_layers
        whole = checked == len(decoder.layers) and full  # the check reads the graph that is written
        partial = decoder if whole else model.decoder(checked)
        if full:
            graph.build(decoder, path)
        check_path = path if whole else path.with_name(path.stem + ".check.onnx")
        if not whole:
            graph.build(partial, check_path)
    except GraphError as err:
        raise BuildError(f"{source}: {err}") from None
    if not whole:
        decoder.notes.append(
            f"read from the GGUF file layer by layer; checked against transformers on its first "
            f"{checked} layers with the embedding and head (the build report scores every layer)"
        )
    info = graph.info_of(decoder)
    checked_info = info if whole else graph.info_of(partial)
    report = graph.check_fused_against_torch(reference, check_path, checked_info, tolerance)
    if not whole:
        for stale in check_path.parent.glob(check_path.name + "*"):
            stale.unlink()
    return info, report


def reduce_head(model, kept: np.ndarray):
    """Replace the output head by one over the kept ids only (untied from the embeddings, which stay full).
    The model then returns logits [B, S, len(kept)], column j for token kept[j]. Here, with ``truncate``: the other
    cut a draft's torch model takes before its graphs are made from it."""
    import torch

    head = model.get_output_embeddings()
    if int(kept.max()) >= head.weight.shape[0]:
        raise BuildError(f"draft_vocab keeps id {int(kept.max())} but the head has {head.weight.shape[0]} rows")
    small = torch.nn.Linear(head.weight.shape[1], len(kept), bias=getattr(head, "bias", None) is not None)
    with torch.no_grad():
        small.weight.copy_(head.weight[torch.as_tensor(kept)])
        if small.bias is not None:
            small.bias.copy_(head.bias[torch.as_tensor(kept)])
    model.set_output_embeddings(small)
    if hasattr(model, "_tied_weights_keys"):
        model._tied_weights_keys = None  # the embeddings keep every row: no tying from here on
    return model


def truncate(model, layers: int):
    """The target's first ``layers`` decoder layers with its embeddings, final norm and head (shared weights); a
    per-layer config list (Gemma 3's ``layer_types``: sliding or full attention) is cut to match.

    Public: the bench's transformers and ONNX Runtime GenAI peers build the same truncated self draft the bundle
    holds (bench/peers/transformers_peer.py, genai_peer.py)."""
    from builder.decoder import clean_config

    draft = _shallow(model)
    draft.model = _shallow(model.model)
    draft.model.layers = model.model.layers[:layers]
    draft.config = clean_config(model.config, layers)
    draft.model.config = draft.config
    return draft


def _shallow(module):
    """A copy of ``module`` sharing its weights but with its own child table (assigning a child to the copy must not
    change the original: copy.copy alone shares the table, which truncated the target too)."""
    import copy

    twin = copy.copy(module)
    twin._modules = dict(module._modules)
    return twin
