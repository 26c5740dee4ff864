"""The --drafter list of ``draftsmith bench``: which drafters one run compares, each a kind (DRAFTERS) or
KIND@BUNDLE (another bundle's draft engine over this bundle's target), opened as the generators the sweep runs."""

from __future__ import annotations

from pathlib import Path

import click

from bench.bench_options import BenchOptions
from runtime.drafter_names import DRAFTERS


def drafter_labels(text: str) -> list[str]:
    """The --drafter list: kinds (DRAFTERS) and KIND@BUNDLE entries, the first a kind; BadParameter otherwise."""
    labels = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    wrong = [label for label in labels if label not in DRAFTERS and label.partition("@")[0] not in DRAFTERS]
    if not labels or wrong or labels[0] not in DRAFTERS:
        raise click.BadParameter(
            f"expected drafter kinds {DRAFTERS} or KIND@BUNDLE, the first a kind; received {text!r}",
            param_hint="--drafter",
        )
    return labels


def drafters_of(options: BenchOptions, generator) -> dict[str, tuple]:
    """label -> (generator, drafter kind) for every --drafter entry; KIND@BUNDLE drafts by KIND with that bundle's
    draft engine over this generator's target (its target tokenizer must be this one's, byte for byte)."""
    out = {}
    for label in drafter_labels(options.drafter_kind):
        kind, _, other = label.partition("@")
        out[label] = (_borrowed_draft(generator, Path(other), options), kind) if other else (generator, label)
    return out


def _borrowed_draft(generator, other: Path, options: BenchOptions):
    """A generator over this one's target and another bundle's draft engine (same target tokenizer)."""
    from runtime.api import SpeculativeGenerator
    from runtime.engines.loading import open_engines
    from runtime.bundle import BundleError, load_manifest

    try:
        manifest = load_manifest(other)
    except BundleError as err:
        raise click.ClickException(f"--drafter KIND@{other}: {err}") from None
    key = "tokenizer/tokenizer.json"
    if manifest.files.get(key) != generator.manifest.files.get(key) or manifest.draft.tokenizer:
        raise click.ClickException(
            f"--drafter KIND@{other}: that bundle's draft does not share this bundle's target "
            "tokenizer (its tokenizer/tokenizer.json differs, or its draft has its own)"
        )
    draft = open_engines(
        other, manifest, generator.tokenizer.vocab_size, ("draft",), options.threads, device=options.device
    )["draft"]
    return SpeculativeGenerator(
        generator.manifest, generator.target, draft, generator.tokenizer, generator.eos_ids, generator.max_k
    )
