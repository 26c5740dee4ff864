"""Stage 5: the draft saved as a Hugging Face folder (safetensors + the target's tokenizer, the kept ids of a reduced
head, the report), staged beside its place and swapped in whole (``builder.publish``, as bundles are).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from builder import publish as publishing
from builder.distill.corpus import DistillError

VOCAB_FILE = "draft_vocab.json"
REPORT_FILE = "distill_report.json"


def save_draft(draft, tokenizer, out: Path, kept: np.ndarray | None, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    draft.hf_quantizer = None
    if hasattr(draft.config, "quantization_config"):
        del draft.config.quantization_config
    for p in draft.parameters():
        p.requires_grad_(False)
    draft.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    vocab_file = out / VOCAB_FILE
    if kept is not None:
        vocab_file.write_text(
            json.dumps({"kept_ids": [int(t) for t in kept], "full_vocab_size": int(draft.config.vocab_size)}),
            encoding="utf-8",
        )
    elif vocab_file.exists():
        vocab_file.unlink()
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2), encoding="utf-8")


def read_draft_vocab(folder: str | Path) -> np.ndarray | None:
    """The kept ids of a reduced-vocabulary draft folder, or None for a full head."""
    path = Path(folder) / VOCAB_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    kept = np.asarray(data["kept_ids"], np.int64)
    if kept.ndim != 1 or len(kept) == 0 or len(np.unique(kept)) != len(kept) or kept.min() < 0:
        raise DistillError(f"{path}: kept_ids must be a non-empty list of distinct non-negative token ids")
    return kept  # in file order: column j of the reduced head is token kept[j] (the runtime reads the same file)


def is_distilled(folder: Path) -> bool:
    """A finished distillation: save_draft writes the report after the weights."""
    return all((folder / name).is_file() for name in ("config.json", "model.safetensors", REPORT_FILE))


def draft_problem(folder: Path) -> str | None:
    """Why --force may not replace ``folder`` (None: a draft this distiller wrote). The mark is the distiller's own
    report, which ``save_draft`` writes into every draft and nothing else writes: a Hugging Face model folder of the
    user's (the target, the checkpoint a draft started from, any other) has a config.json and weights too, and
    --force must never delete one."""
    report = folder / REPORT_FILE
    if report.is_symlink() or not report.is_file():
        return f"it holds no {REPORT_FILE}, so draftsmith distill did not write it (a model of your own?)"
    return None


DRAFT = publishing.Kind("draft folder", draft_problem, DistillError)


def check_out(out: Path, force: bool, sources: tuple[str, ...] = ()) -> None:
    """Refuse ``out`` when it is, holds or lies inside one of ``sources`` (the target, an init checkpoint), and an
    existing ``out`` unless ``force`` and it is a draft folder (``builder.publish.check_output``)."""
    for source in sources:
        clash = _overlap(out, source)
        if clash:
            raise DistillError(
                f"--out {out} {clash} {source}, which the distillation reads; nothing was touched. "
                "Choose an output folder apart from it."
            )
    publishing.check_output(out, force, DRAFT)


def _overlap(out: Path, source: str) -> str | None:
    """How ``out`` overlaps the file or folder ``source`` names (None: apart, or ``source`` is not a path here)."""
    from builder.checkpoint import CheckpointError, locate

    try:
        path = locate(source).resolve()
    except (CheckpointError, OSError):
        return None  # not a checkpoint on this machine: loading it fails on its own, and it is nowhere near out
    here = out.resolve()
    if here == path:
        return "is"
    if path in here.parents:
        return "lies inside"
    if here in path.parents:
        return "holds"
    return None


def publish_draft(draft, tokenizer, out: Path, kept, report: dict, force: bool, also=None) -> None:
    """Write the draft into a hidden folder beside ``out`` and swap it in whole (``builder.publish``, as bundles are):
    an interrupted save leaves the previous draft, never a half-written one next to a finished-looking report."""
    with publishing.staging(out, force, DRAFT) as tmp:
        save_draft(draft, tokenizer, tmp, kept, report)
        if also is not None:  # more files of the draft (a feature draft's own weights), before the swap
            also(tmp)
        publishing.publish(tmp, out)
