"""What every peer shares: finding the bundle's sources (checked by sha256), our own reference figures, and the
timed rows each peer returns (see ``bench/peers/__init__.py`` for the row format).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable

from runtime.bundle import Manifest, ModelEntry


class PeerError(Exception):
    """A peer cannot run on this bundle; the message says why and what to do."""


def skip(peer: str, reason: str) -> dict:
    return {"peer": peer, "skipped": reason}


def quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # GGUF dequantization bars would tear through the bench's own output
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


# --- the bundle's sources -------------------------------------------------------------------------------------------


def source_candidates(entry: ModelEntry, bundle: Path) -> list[Path]:
    """Where the checkpoint of ``entry`` may be now, in order: its package (``pkg:``), the absolute path recorded at
    build time, then a relative source against each folder above the bundle (``bundles/x`` built from the project
    root: the grandparent) and the working directory. Candidates are only places to look: the caller checks the
    weights' sha256."""
    from builder.checkpoint import CheckpointError, locate

    source = entry.source
    if entry.role == "draft" and (source == "self" or source.startswith("self:")):
        raise ValueError("a self draft has no checkpoint of its own: locate the target's")
    out: list[Path] = []
    if source.startswith("pkg:"):
        with contextlib.suppress(CheckpointError):
            out.append(locate(source))
    if entry.source_resolved:
        out.append(Path(entry.source_resolved))
    typed = Path(source).expanduser()
    if not source.startswith("pkg:"):
        if typed.is_absolute():
            out.append(typed)
        else:
            out += [folder / typed for folder in Path(bundle).resolve().parents] + [Path.cwd() / typed]
    return list(dict.fromkeys(out))


def locate_checkpoint(entry: ModelEntry, bundle: Path, allow_pickle: bool = False, trust_remote_code: bool = False):
    """The checkpoint ``entry`` was built from, found from any working directory and checked by sha256.

    Raises PeerError naming every place tried when none holds the same weights."""
    from builder.checkpoint import CheckpointError, resolve

    tried = []
    for path in source_candidates(entry, bundle):
        if not path.exists():
            tried.append(f"{path} (missing)")
            continue
        try:
            checkpoint = resolve(str(path), allow_pickle, trust_remote_code)
        except CheckpointError as err:
            tried.append(f"{path} ({err})")
            continue
        if checkpoint.sha256() == entry.source_sha256:
            return checkpoint
        tried.append(f"{path} (other weights: sha256 differs from the manifest's)")
    raise PeerError(
        f"the {entry.role}'s source {entry.source!r} was not found: tried "
        + "; ".join(tried)
        + ". Run the bench from the folder the bundle was built in, or put the checkpoint back."
    )


def target_and_draft(manifest: Manifest, bundle: Path, consent: dict):
    """(target checkpoint, draft checkpoint or None for a self draft)."""
    target = locate_checkpoint(manifest.target, bundle, **consent)
    draft = manifest.spec.draft
    if draft == "self" or draft.startswith("self:"):
        return target, None
    return target, locate_checkpoint(manifest.draft, bundle, **consent)


def self_layers(manifest: Manifest) -> int:
    """N of a ``self:layers=N`` draft, else 0."""
    option = manifest.spec.draft.partition(":")[2]
    return int(option[7:]) if option.startswith("layers=") else 0


# --- our own reference ----------------------------------------------------------------------------------------------


def strip_eos(ids: list[int], eos_ids) -> list[int]:
    """Greedy ids without a trailing end-of-sequence token (runtimes differ on whether they return it)."""
    ids = list(ids)
    while ids and ids[-1] in eos_ids:
        ids.pop()
    return ids


def compare_with_ours(rows: list[dict], ours: dict[str, dict], eos_ids) -> list[dict]:
    """Add ``speedup_vs_ours_target`` and ``identical_to_ours`` (the share of prompts whose greedy ids equal our
    target-only ids) to each peer row; ``ours`` is {workload: {"target_tokens_per_second", "token_ids"}} over the
    same prompts."""
    eos = set(eos_ids)
    for row in rows:
        mine = ours.get(row.get("workload"))
        ids = row.pop("token_ids", None)
        if "skipped" in row or mine is None:
            continue
        base = mine["target_tokens_per_second"]
        row["speedup_vs_ours_target"] = row["tokens_per_second"] / base if base else None
        decode = row.get("decode_tokens_per_second")  # llama.cpp's tools: the rate after the first token
        if decode:
            for ours_key, key in (
                ("target_decode_tokens_per_second", "ours_plain_decode_vs_this"),
                ("speculative_decode_tokens_per_second", "ours_speculative_decode_vs_this"),
            ):
                if mine.get(ours_key):
                    row[key] = mine[ours_key] / decode
        if ids is not None and len(ids) == len(mine["token_ids"]):
            same = [strip_eos(a, eos) == strip_eos(b, eos) for a, b in zip(ids, mine["token_ids"])]
            row["identical_to_ours"] = sum(same) / len(same) if same else None
    return rows


def timed_rows(
    peer: str, workload: str, prompts: list[list[int]], modes: dict[str, Callable], k: int, progress, **extra
) -> list[dict]:
    """Run each mode's ``generate(ids) -> new ids`` over the prompts (the first one once more, untimed, first) and
    shape the rows; speedup is over the mode named "plain"."""
    results = {}
    for mode, generate in modes.items():
        tokens, wall, outputs = 0, 0.0, []
        for i, ids in enumerate([prompts[0]] + prompts):
            start = time.perf_counter()
            new = generate(ids)
            elapsed = time.perf_counter() - start
            if i == 0:
                continue
            outputs.append([int(t) for t in new])
            tokens += len(new)
            wall += elapsed
            if progress:
                progress(f"{peer} {mode} {workload}")
        results[mode] = {
            "prompts": len(prompts),
            "tokens": tokens,
            "wall_seconds": wall,
            "tokens_per_second": tokens / wall if wall else 0.0,
            "token_ids": outputs,
        }
    base = results.get("plain", {}).get("tokens_per_second")
    return [
        {
            "peer": peer,
            "workload": workload,
            "mode": mode,
            "k": None if mode == "plain" else k,
            **r,
            "speedup": r["tokens_per_second"] / base if base else None,
            **extra.get(mode, {}),
        }
        for mode, r in results.items()
    ]


def is_feature_draft(manifest: Manifest) -> bool:
    """The bundle's draft reads the target's hidden states (runtime/drafters/feature.py): peers get no draft mode."""
    return "features" in manifest.draft.input_names
