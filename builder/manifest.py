"""Stage 6: a bundle's files beside its engines (the tokenizers, a reduced head's kept ids) and its manifest's fields
(each role's entry, the end-of-sequence ids, the tools that built it). Shared with the TensorRT-LLM build
(builder/trtllm/build.py), whose bundles carry the same fields.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import metadata
from pathlib import Path

from builder.errors import BuildError
from runtime.bundle import BuildSpec, Manifest, ModelEntry

VOCAB_MAP = "draft_vocab.json"  # a reduced-vocabulary draft head's kept token ids (draft folder and bundle alike)
DRAFT_TOKENIZER = "draft/tokenizer"  # a cross-tokenizer draft's own tokenizer in the bundle (ModelEntry.tokenizer)
TOOLS = ("draftsmith", "torch", "transformers", "onnx", "onnxscript", "onnxruntime", "gguf", "tokenizers")


def save_tokenizers(tmp: Path, target_tok, draft_tok, kept) -> None:
    """The bundle's tokenizers: the target's with a reduced draft head's kept ids, and a cross-tokenizer draft's own
    (``draft_tok``; None where the draft reads the target's)."""
    _save_tokenizer(tmp, target_tok, kept)
    if draft_tok is not None:
        _save_draft_tokenizer(tmp, draft_tok)


def bundle_manifest(tmp: Path, spec: BuildSpec, pair, checkpoints, infos, kept, target_tok, report: dict) -> Manifest:
    """The manifest of the bundle in ``tmp`` before its files are hashed: each role's entry (``checkpoints`` and
    ``infos``: the target's and the draft's checkpoint and graph info), with the draft's vocab_map and tokenizer
    where it has its own."""
    entries = {
        role: _entry(role, c, info, quant, tmp, pair.max_context, spec)
        for role, c, info, quant in zip(("target", "draft"), checkpoints, infos, (spec.target_quant, spec.draft_quant))
    }
    if kept is not None:
        entries["draft"] = dataclasses.replace(entries["draft"], vocab_map=f"draft/{VOCAB_MAP}")
    if pair.cross:
        entries["draft"] = dataclasses.replace(entries["draft"], tokenizer=DRAFT_TOKENIZER)
    return Manifest(
        spec=spec,
        target=entries["target"],
        draft=entries["draft"],
        files={},
        default_k=spec.k,
        max_context=pair.max_context,
        eos_token_ids=eos_ids(checkpoints[0], target_tok),
        tools=tool_versions(),
        report=report,
    )


def _save_tokenizer(tmp: Path, target_tok, kept) -> None:
    """The target's tokenizer (as tokenizer.json: the runtime reads the fast form only) and a reduced draft head's
    kept ids."""
    target_tok.save_pretrained(str(tmp / "tokenizer"))
    if not (tmp / "tokenizer" / "tokenizer.json").is_file():
        raise BuildError("the target's tokenizer could not be saved as tokenizer.json (a fast tokenizer is needed)")
    if kept is not None:
        (tmp / "draft" / VOCAB_MAP).write_text(json.dumps({"kept_ids": [int(t) for t in kept]}), encoding="utf-8")


def _save_draft_tokenizer(tmp: Path, draft_tok) -> None:
    """A cross-tokenizer draft's own tokenizer, as tokenizer.json (the runtime bridges the two vocabularies by it)."""
    folder = tmp / DRAFT_TOKENIZER
    draft_tok.save_pretrained(str(folder))
    if not (folder / "tokenizer.json").is_file():
        raise BuildError("the draft's tokenizer could not be saved as tokenizer.json (a fast tokenizer is needed)")


def _entry(role, checkpoint, info, quant, tmp: Path, max_context: int, spec: BuildSpec) -> ModelEntry:
    engine = f"{role}/model.onnx"
    size = sum(p.stat().st_size for p in (tmp / role).iterdir() if p.is_file())  # not a draft's own tokenizer
    source = spec.target if role == "target" else spec.draft
    return ModelEntry(
        role=role,
        source=source,
        source_sha256=checkpoint.sha256(),
        architecture=checkpoint.architecture.name,
        quant=quant,
        engine=engine,
        num_layers=info.num_layers,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        vocab_size=info.vocab_size,
        max_context=max_context,
        input_names=info.input_names,
        output_names=info.output_names,
        size_bytes=size,
        graph=info.graph,
        min_call_tokens=_min_call_tokens(role, info.graph, tmp / engine),
        source_resolved=str(checkpoint.folder.joinpath(checkpoint.gguf_file or "").resolve()),
    )


def _min_call_tokens(role: str, graph_kind: str, engine: Path) -> int:
    """2 for a fused target with GroupQueryAttention or MatMulNBits: a one-token call takes other kernels than a
    verify call on every CPU measured (MatMulNBits' one-row int8 kernel, GroupQueryAttention's one-query SGEMM;
    runtime.engines.fused.FusedEngine), so its one-token calls are padded to two; 1 for a target made of
    Draftsmith's own operators only (GgufMatMul and CausalAttention score a token alike in any call), and elsewhere
    (a draft need not be exact)."""
    if role != "target" or graph_kind != "fused":
        return 1
    import onnx

    ops = {node.op_type for node in onnx.load(str(engine), load_external_data=False).graph.node}
    return 2 if ops & {"GroupQueryAttention", "MatMulNBits"} else 1


def eos_ids(checkpoint, tokenizer) -> tuple[int, ...]:
    """The target's end-of-sequence ids for the manifest: its config's, its generation_config.json's (not for a GGUF
    source) and its tokenizer's. Public: the TensorRT-LLM build writes the same manifest field
    (builder/trtllm/build.py)."""
    ids = set()
    generation_file = checkpoint.folder / "generation_config.json"
    generation = (
        json.loads(generation_file.read_text(encoding="utf-8")).get("eos_token_id")
        if generation_file.is_file() and not checkpoint.gguf_file
        else None
    )
    eos = getattr(checkpoint.config, "eos_token_id", None)
    for value in (eos, generation, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


def tool_versions() -> dict[str, str]:
    """The installed versions of ``TOOLS`` for the manifest's ``tools``. Public: the TensorRT-LLM build records the
    same (builder/trtllm/build.py)."""
    versions = {}
    for name in TOOLS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions
