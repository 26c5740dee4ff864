"""Training pairs on disk: each sample's token ids and the target's hidden state at every position, written in shards
as they are made.

A feature draft learns from the target's hidden states (float16, 3 KB a token for a 1,536-wide target): held in
memory, 200,000 tokens of them would take 600 MB and a killed run would lose them all. Here every batch of samples is
written as a shard (two ``.npy`` files, renamed into place whole) and named in the folder's manifest, which is
replaced atomically after the shard is; a run that is killed and started again finds what was made and makes only the
rest. Reading maps the feature files (``mmap_mode="r"``): the training batches pull in what they use, and the page
cache, not the process, holds the rest.

The manifest records what the shards were made from (``fingerprint``: the target's sha256, the corpus, the window
length, ...). A folder made for other data is emptied rather than mixed in. Each shard lists the plan items it holds
(``items``: integers the caller assigns, e.g. the index of a text window in its plan), so the caller skips them.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from builder.distill.corpus import DistillError, Sample

MANIFEST = "manifest.json"
SCHEMA = 1
# A shard's name as ``add`` makes it: a file name of the folder, no separator, '..' or absolute path (the manifest is
# read back from disk and its names joined to the folder)
SHARD_NAME = re.compile(r"shard-[0-9]{5,}")


class ShardStore:
    """The shards of one folder, for data made from ``fingerprint`` (a JSON-able dict)."""

    def __init__(self, folder: Path, fingerprint: dict):
        self.folder = Path(folder)
        self.fingerprint = json.loads(json.dumps(fingerprint))  # as it reads back from the manifest
        self.folder.mkdir(parents=True, exist_ok=True)
        manifest = self._read()
        if manifest is None or manifest.get("fingerprint") != self.fingerprint:
            self._clear()
            manifest = {"schema": SCHEMA, "fingerprint": self.fingerprint, "shards": []}
            self._write(manifest)
        self.manifest = manifest

    @property
    def shards(self) -> list[dict]:
        return self.manifest["shards"]

    def done(self) -> set[int]:
        """The plan items the shards hold."""
        return {item for shard in self.shards for item in shard["items"]}

    @property
    def tokens(self) -> int:
        return sum(sum(shard["lengths"]) for shard in self.shards)

    def add(self, samples: list[Sample], items: list[int]) -> None:
        """Write ``samples`` (each with ``features`` [L-1, H]) as one shard holding plan ``items``."""
        if not samples:
            return
        name = f"shard-{len(self.shards):05d}"
        ids = np.concatenate([np.asarray(s.ids, np.int32) for s in samples])
        features = np.concatenate([np.asarray(s.features[: len(s.ids) - 1], np.float16) for s in samples])
        for suffix, array in (("ids", ids), ("features", features)):
            partial = self.folder / f"{name}.{suffix}.partial.npy"
            np.save(partial, array)
            os.replace(partial, self.folder / f"{name}.{suffix}.npy")
        entry = {
            "name": name,
            "items": [int(i) for i in items],
            "lengths": [len(s.ids) for s in samples],
            "prompt_lengths": [len(s.prompt) for s in samples],
        }
        manifest = dict(self.manifest, shards=[*self.shards, entry])
        self._write(manifest)
        self.manifest = manifest

    def samples(self) -> list[Sample]:
        """Every sample, its features a read-only map of the shard's file, in the order of their plan items (not
        of the shards: a resumed run writes them in another order, and training reads them in this one)."""
        out = []
        for shard in self.shards:
            ids = np.load(self.folder / f"{shard['name']}.ids.npy")
            features = np.load(self.folder / f"{shard['name']}.features.npy", mmap_mode="r")
            at = feature_at = 0
            for item, length, prompt in zip(shard["items"], shard["lengths"], shard["prompt_lengths"]):
                row = ids[at : at + length].tolist()
                feats = features[feature_at : feature_at + length - 1]
                out.append((item, Sample(row[:prompt], row[prompt:], features=feats)))
                at += length
                feature_at += length - 1
        return [sample for _, sample in sorted(out, key=lambda pair: pair[0])]

    def _read(self) -> dict | None:
        path = self.folder / MANIFEST
        if not path.is_file():
            return None
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None  # a torn or foreign file: the folder starts afresh
        if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
            return None
        for shard in manifest.get("shards", []):
            name = shard.get("name") if isinstance(shard, dict) else None
            if not isinstance(name, str) or not SHARD_NAME.fullmatch(name):
                raise DistillError(
                    f"{self.folder}: the manifest names a shard {name!r}, not one of this folder's shard files "
                    "(shard-NNNNN); delete the folder to make the data again"
                )
            for suffix in ("ids", "features"):
                if not (self.folder / f"{shard.get('name')}.{suffix}.npy").is_file():
                    raise DistillError(
                        f"{self.folder}: shard {shard.get('name')} is in the manifest but its {suffix} file is "
                        "missing; delete the folder to make the data again"
                    )
        return manifest

    def _write(self, manifest: dict) -> None:
        partial = self.folder / (MANIFEST + ".partial")
        with open(partial, "w", encoding="utf-8") as handle:
            json.dump(manifest, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, self.folder / MANIFEST)

    def _clear(self) -> None:
        """Remove the shard files of other data (only files this store names: ``shard-*.npy`` and its manifest)."""
        for path in self.folder.glob("shard-*.npy"):
            path.unlink()
        (self.folder / MANIFEST).unlink(missing_ok=True)
