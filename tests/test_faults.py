"""Faults while building: a full disk and a build killed at random points never leave a loadable partial bundle, and
what a killed build leaves behind is removed by the next one."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from builder.build import BuildError, build
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
    """The build-engines command line both kill tests run: the tiny target with an int8 self-draft into ``out``."""
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
        "--out",
        str(out),
    ]


KILLS = 10


@pytest.mark.slow
def test_build_killed_at_random_points_never_leaves_a_loadable_partial_bundle(tiny_pair, tmp_path):
    out = tmp_path / "bundle"
    command = [*self_draft_build(tiny_pair[0], out), "--force"]
    started = time.perf_counter()
    assert subprocess.run(command, capture_output=True).returncode == 0  # one whole build: how long it takes here
    whole = time.perf_counter() - started
    rng = random.Random(20)
    for i in range(KILLS):  # a kill point in each of KILLS equal slices of the build's time (every stage is hit)
        process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        time.sleep(whole * (i + rng.random()) / KILLS)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
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
