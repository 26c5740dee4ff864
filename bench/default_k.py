"""``draftsmith bench --write-k``: the one place the bench writes into a bundle (its default_k), kept apart from
the measurement so the write is seen and reviewed on its own."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from bench.speed_report import recommended_k


def write_default_k(bundle: Path, k: int) -> None:
    """Store k as the bundle's default_k. Only manifest.json changes (it is not among the hashed files), atomically."""
    from runtime.bundle import load_manifest, write_manifest_atomic

    manifest = load_manifest(bundle, verify=True)
    if k > manifest.spec.max_k:
        raise click.ClickException(f"k={k} exceeds this bundle's max_k ({manifest.spec.max_k})")
    write_manifest_atomic(bundle, dataclasses.replace(manifest, default_k=k))


def store_recommended_k(bundle: Path, report: dict) -> None:
    """The recommended k becomes the bundle's default_k, and the report says so (nothing without one)."""
    rec_k = recommended_k(report)
    if rec_k is not None:
        write_default_k(bundle, rec_k)
        report["recommended_k"]["written"] = True
        report["recommended_k"]["bundle_default_k"] = rec_k
