"""Faults while building: a full disk and a build killed at random points never leave a loadable partial bundle, and
what a killed build leaves behind is removed by the next one."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from builder.build import build

from builder.errors import BuildError
from conftest import EVAL_TOKENS
from runtime.bundle import BuildSpec, BundleError, load_manifest


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (the tiny bundle needs more); skipped where mounting is not permitted."""
    mount = tmp_path / "small"
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_disk_full_is_a_clear_error_and_leaves_nothing(tiny_pair, small_disk):
    with pytest.raises(BuildError, match="disk full"):
        build(BuildSpec(target=str(tiny_pair[0]), draft="self", draft_quant="int8"), small_disk / "bundle")
    assert list(small_disk.iterdir()) == []


def self_draft_build(target, out) -> list[str]:
    """The build-engines command line both kill tests run: the tiny target with an int8 self-draft into ``out`` (the
    report scored on EVAL_TOKENS tokens: every stage still runs, the evaluation a second rather than ten)."""
    return [
        sys.executable,
        "-m",
        "builder.cli",
        "--target",
        str(target),
        "--draft",
        "self",
        "--draft-quant",
        "int8",
        "--allow-slow-draft",  # a subprocess: conftest's slow_drafts_built does not reach it
        "--eval-tokens",
        str(EVAL_TOKENS),
        "--out",
        str(out),
    ]


STAGE_LINE = re.compile(r"^build-engines: (?P<stage>[a-z][a-z ]*) \(\d+ s\)$")  # builder/cli.py, as a stage starts


def started_build(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def wait_for_stage(process: subprocess.Popen, stage: str | None = None) -> str | None:
    """Read the build's progress until ``stage`` starts (any stage when None); its name, or None at the end."""
    for line in process.stderr:
        match = STAGE_LINE.match(line.strip())
        if match and stage in (None, match["stage"]):
            return match["stage"]
    return None


def stage_seconds(command: list[str]) -> dict[str, float]:
    """One whole build: each stage's seconds here (when its line came to when the next one did, or the exit)."""
    process, starts = started_build(command), []
    while (stage := wait_for_stage(process)) is not None:
        starts.append((stage, time.monotonic()))
    assert process.wait() == 0
    ends = [t for _, t in starts[1:]] + [time.monotonic()]
    return {stage: end - start for (stage, start), end in zip(starts, ends)}


@pytest.mark.slow
def test_build_killed_in_each_stage_never_leaves_a_loadable_partial_bundle(tiny_pair, tmp_path):
    """One SIGKILL in each of the build's stages, at a random point of the stage's first half (at its start when it is
    short): every kill hits a running build (it had announced the stage, and died of the signal), and whatever it
    left is never a loadable bundle."""
    out = tmp_path / "bundle"
    command = [*self_draft_build(tiny_pair[0], out), "--force"]
    seconds = stage_seconds(command)
    assert len(seconds) >= 8  # resolve, pair, export and quantize each engine, evaluate, tokenizer, manifest
    rng = random.Random(20)
    for stage, length in seconds.items():
        process = started_build(command)
        assert wait_for_stage(process, stage) == stage
        time.sleep(rng.random() * length / 2 if length > 0.2 else 0.0)
        os.killpg(process.pid, signal.SIGKILL)
        assert process.wait() == -signal.SIGKILL, f"the build had ended before the kill in {stage!r}"
        process.stderr.close()
        if out.exists():  # whatever is at `out` is a complete bundle (the first run's, or a later finished one)
            load_manifest(out)
        for partial in tmp_path.glob(".bundle.partial-*"):
            with pytest.raises(BundleError):
                load_manifest(partial)
    rerun = subprocess.run(command, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    load_manifest(out)
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]  # the killed runs' partial folders are gone too


def test_a_killed_build_leaves_a_partial_folder_that_the_next_build_removes(tiny_pair, tmp_path, caplog):
    """SIGKILL (or the OOM killer) gives a build no chance to clean up; the next build on the same output does, and
    says so."""
    out = tmp_path / "bundle"
    command = self_draft_build(tiny_pair[0], out)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".bundle.partial-*/target")) and process.poll() is None:
        assert time.monotonic() < deadline, "the build never started writing"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    (partial,) = tmp_path.glob(".bundle.partial-*")

    def stop(name):
        raise KeyboardInterrupt(name)

    with pytest.raises(KeyboardInterrupt):
        build(BuildSpec(target=str(tiny_pair[0]), draft="self"), out, on_stage=stop)
    assert not partial.exists() and list(tmp_path.iterdir()) == []
    assert f"removed {partial.name}" in caplog.text and "killed" in caplog.text
