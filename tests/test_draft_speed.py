"""Never a draft slower than its target: a build measures the draft's one-token call against the target's
(builder.draft_choice.draft_call_ratio) and refuses a draft that costs as much or more, with the measured ratio and
what to do, unless the spec allows it. The decision is tested with the ratio injected: the tiny pairs' draft and
target are the same size, so their measured ratio is ~1.0 either side by chance (tests/conftest.py lets every other
test build through)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from click.testing import CliRunner

from builder import draft_choice
from builder.errors import BuildError
from runtime.bundle import BuildSpec


@pytest.fixture
def measured(monkeypatch):
    """The refusal as a user's build makes it, with the measurement replaced by the ratio the test sets."""
    monkeypatch.setattr(draft_choice, "SLOW_DRAFT", 1.0)

    def set_ratio(ratio: float) -> None:
        monkeypatch.setattr(draft_choice, "draft_call_ratio", lambda *args: ratio)

    return set_ratio


def test_a_draft_as_costly_as_its_target_or_more_is_refused_with_the_measured_ratio():
    spec = BuildSpec(target="t", draft="d")
    for ratio in (1.0, 1.37):
        with pytest.raises(BuildError, match=rf"costs {ratio:.2f} of the target's.*--allow-slow-draft"):
            draft_choice.refuse_slow_draft(ratio, spec, limit=1.0)
    draft_choice.refuse_slow_draft(0.99, spec, limit=1.0)
    draft_choice.refuse_slow_draft(1.37, replace(spec, allow_slow_draft=True), limit=1.0)


def test_a_build_refuses_a_slow_draft_before_its_evaluation_and_leaves_no_bundle(tiny_pair, tmp_path, measured):
    from builder.build import build

    measured(1.25)
    stages, out = [], tmp_path / "out"
    spec = BuildSpec(target=str(tiny_pair[0]), draft=str(tiny_pair[1]), target_quant="fp32", draft_quant="fp32",
                     max_context=128)  # fmt: skip
    with pytest.raises(BuildError, match=r"costs 1\.25 of the target's"):
        build(spec, out, on_stage=stages.append)
    assert "time draft" in stages and "evaluate" not in stages and not out.exists()


def test_allow_slow_draft_builds_it_and_the_report_keeps_the_ratio(tiny_pair, tmp_path, measured):
    from builder.cli import main
    from runtime.bundle import load_manifest

    measured(1.25)
    out = tmp_path / "out"
    args = ["--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--target-quant", "fp32", "--draft-quant",
            "fp32", "--max-context", "128", "--eval-tokens", "128", "--out", str(out)]  # fmt: skip
    refused = CliRunner().invoke(main, args)
    assert refused.exit_code != 0 and "--allow-slow-draft" in refused.output and not out.exists()
    allowed = CliRunner().invoke(main, [*args, "--allow-slow-draft"])
    assert allowed.exit_code == 0, allowed.output
    manifest = load_manifest(out)
    assert manifest.spec.allow_slow_draft and manifest.report["draft_call_vs_target"] == 1.25


def test_every_build_measures_its_draft_against_its_target(tiny_bundle):
    from runtime.bundle import load_manifest

    ratio = load_manifest(tiny_bundle).report["draft_call_vs_target"]  # measured for real: no bound asserted
    assert math.isfinite(ratio) and ratio > 0
