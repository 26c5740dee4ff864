"""The GGUF operator library's own tests (tests/test_gguf_kernels.py: every type, layout and instruction set against
the oracle; tests/test_gguf_ops_crafted.py: crafted attributes, shapes, ids) run again against the library built
with -fsanitize=address,undefined (``python -m runtime.engines.gguf_ops.build --sanitize``, into build-asan/), in a
Python that preloads the sanitizer runtime: not one report.

The interpreter is not built with the sanitizers, so LD_PRELOAD puts libasan first (it must be the first library
loaded) and libstdc++ after it: ASan's __cxa_throw interceptor looks up the real one when ASan starts, and Python does
not load libstdc++ by itself, so without it the first C++ exception the library throws (every clean refusal) aborts
the process. ASAN_OPTIONS=detect_leaks=0: the interpreter leaks by design at exit (interned objects, module state,
ONNX Runtime's singletons), which LeakSanitizer would report as leaks of the process; the library's own memory is
vectors and the sessions' kernels, freed by their owners. UBSan stops at its first report
(-fno-sanitize-recover=all), as ASan does. Skipped, with the reason, where gcc has no sanitizer runtime or the
sanitizer build cannot be made here."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.engines import gguf_ops

ROOT = Path(__file__).resolve().parent.parent
REPORT = re.compile(r"ERROR: \w+Sanitizer|runtime error:|Sanitizer: CHECK failed")
THE_LIBRARYS_TESTS = ["tests/test_gguf_ops_crafted.py", "tests/test_gguf_kernels.py", "-k", "not emulated"]

pytestmark = pytest.mark.skipif(not gguf_ops.available(), reason=f"{gguf_ops.unavailable_reason()}")


def _gcc_runtime(name: str) -> str | None:
    """The path gcc links ``name`` from, or None where it has none (gcc then prints the bare name back)."""
    if shutil.which("gcc") is None:
        return None
    found = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return found if os.path.isabs(found) and os.path.exists(found) else None


@pytest.fixture(scope="module")
def sanitized() -> dict:
    """The environment of a process that runs the sanitizer build: the runtime preloaded, the library named."""
    from runtime.engines.gguf_ops import build

    preload = [_gcc_runtime("libasan.so"), _gcc_runtime("libstdc++.so")]
    if None in preload:
        pytest.skip(
            "no sanitizer runtime here (`gcc -print-file-name=libasan.so` names no file): install gcc's libasan"
        )
    try:
        library = build.build(sanitize=True)
    except (build.BuildFailed, OSError) as err:
        pytest.skip(f"the sanitizer build of the GGUF kernels cannot be made here: {err}")
    return {
        **os.environ,
        "LD_PRELOAD": " ".join(preload),
        "ASAN_OPTIONS": "detect_leaks=0",
        "UBSAN_OPTIONS": "print_stacktrace=1",
        gguf_ops.LIBRARY_ENV: str(library),
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _python(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_sanitizer_is_in_the_process_and_reports_a_read_past_the_weights(sanitized):
    """The harness's own check: a call told of 64 rows of weights over a buffer of 32 is reported (so a clean run
    below means clean, not a sanitizer that never loaded)."""
    script = (
        "import ctypes, numpy as np\n"
        "from runtime.engines import gguf_ops\n"
        "library = ctypes.CDLL(str(gguf_ops.library_path()))\n"
        "w, x, y = np.zeros((32, 68), np.uint8), np.ones((1, 64), np.float32), np.zeros((1, 64), np.float32)\n"
        "p = lambda a: a.ctypes.data_as(ctypes.c_void_p)\n"
        "library.DraftsmithGgufDot(b'scalar', 8, 0, p(w), ctypes.c_int64(64), ctypes.c_int64(64), p(x),\n"
        "                          ctypes.c_int64(1), p(y))\n"
    )
    done = _python(sanitized, "-c", script)
    assert done.returncode != 0 and "AddressSanitizer: heap-buffer-overflow" in done.stderr, done.stderr[-3000:]


def test_the_librarys_tests_pass_against_the_sanitizer_build_without_a_report(sanitized):
    # --capture=sys: a report written to fd 2 as the process dies is not lost in pytest's capture file
    done = _python(sanitized, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--capture=sys", *THE_LIBRARYS_TESTS)
    output = done.stdout + done.stderr
    report = REPORT.search(output)
    assert report is None, output[max(0, report.start() - 500) : report.start() + 4000]
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, output[-4000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 150 and "skipped" not in summary, summary
