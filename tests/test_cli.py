"""draftsmith generate (runtime/cli.py): its JSON report, its streamed output and its errors."""

from __future__ import annotations

import pytest


def test_generate_command_json(tiny_bundle):
    import json
    from click.testing import CliRunner
    from runtime.cli import main

    result = CliRunner().invoke(
        main,
        [
            "generate",
            str(tiny_bundle),
            "The quick brown",
            "--max-new-tokens",
            "20",
            "--k",
            "3",
            "--threads",
            "1",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["identical_to_target"] is True
    assert report["speculative"]["num_emitted_tokens"] == 20 == len(report["token_ids"])
    assert 0 <= report["speculative"]["draft_acceptance_rate"] <= 1 and report["speedup"] > 0
    # the speedup is over plain decoding (unpadded calls); identity is against the padded (exact) target-only run
    assert report["target_only"]["num_emitted_tokens"] == 20 == report["target_only_padded"]["num_emitted_tokens"]
    plain = report["target_only"]["tokens_per_second"]
    assert report["speedup"] == pytest.approx(report["speculative"]["tokens_per_second"] / plain, rel=1e-3)


def test_generate_command_stream_and_errors(tiny_bundle, tmp_path):
    from click.testing import CliRunner
    from runtime.cli import main

    streamed = CliRunner().invoke(
        main, ["generate", str(tiny_bundle), "def add(a, b):", "--max-new-tokens", "12", "--stream", "--threads", "1"]
    )
    assert streamed.exit_code == 0 and "acceptance rate" in streamed.output and "speedup" in streamed.output
    bad = CliRunner().invoke(main, ["generate", str(tiny_bundle), "hi", "--k", "0"])
    assert bad.exit_code != 0 and "k: expected" in bad.output
    missing = CliRunner().invoke(main, ["generate", str(tmp_path / "none"), "hi"])
    assert missing.exit_code != 0 and "no bundle at" in missing.output
