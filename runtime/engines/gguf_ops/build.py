"""Build the GGUF kernel library (runtime/engines/gguf_ops/src) into runtime/engines/gguf_ops/build/::

    python -m runtime.engines.gguf_ops.build             # scripts/setup.sh runs this
    python -m runtime.engines.gguf_ops.build --sanitize  # the tests' AddressSanitizer/UBSan variant, in build-asan/

It needs a C++17 compiler, cmake, and ONNX Runtime's C/C++ API headers (API version 21 or newer). No pip package
ships those headers; they come from Debian's ``libonnxruntime-dev`` (85 KB, headers only), downloaded and unpacked
into the build folder — not installed — from the machine's own Debian sources, or from Debian trixie's where the
release at hand has no such package (bookworm). ``ORT_INCLUDE_DIR`` points at headers you already have. Where any of
this is missing the build says why and exits 1; the project then keeps ONNX Runtime's MatMulNBits (slower).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from runtime.engines.gguf_ops import BUILD_DIR, LIBRARY_NAME

SOURCE_DIR = Path(__file__).parent
SANITIZED_DIR = SOURCE_DIR / "build-asan"  # apart from build/: an engine never loads this variant
HEADER = "onnxruntime_cxx_api.h"
DEBIAN_PACKAGE = "libonnxruntime-dev"
# Debian's own archive, the suite that has the package (trixie: onnxruntime 1.21, API 21)
TRIXIE_SOURCES = """Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


class BuildFailed(RuntimeError):
    """The library could not be built here; the message says what is missing."""


def headers() -> Path:
    """A folder holding onnxruntime_cxx_api.h: $ORT_INCLUDE_DIR, one unpacked earlier, or Debian's package now."""
    given = os.environ.get("ORT_INCLUDE_DIR")
    if given:
        if not (Path(given) / HEADER).is_file():
            raise BuildFailed(f"ORT_INCLUDE_DIR={given} holds no {HEADER}")
        return Path(given)
    unpacked = BUILD_DIR / "ort-headers"
    found = next(unpacked.rglob(HEADER), None) if unpacked.is_dir() else None
    if found is not None:
        return found.parent
    _fetch_headers(unpacked)
    found = next(unpacked.rglob(HEADER), None)
    if found is None:
        raise BuildFailed(f"Debian's {DEBIAN_PACKAGE} held no {HEADER}")
    return found.parent


def _fetch_headers(into: Path) -> None:
    if not shutil.which("apt-get") or not shutil.which("dpkg"):
        raise BuildFailed(f"no apt-get/dpkg to fetch {DEBIAN_PACKAGE}; set ORT_INCLUDE_DIR to ONNX Runtime's headers")
    with tempfile.TemporaryDirectory(prefix="draftsmith-ort-headers-") as tmp:
        work = Path(tmp)
        deb = _download(work, []) or _download(work, _trixie_options(work))
        if deb is None:
            raise BuildFailed(
                f"apt-get could not download {DEBIAN_PACKAGE} (from this machine's sources or Debian trixie); "
                "set ORT_INCLUDE_DIR to ONNX Runtime's C/C++ API headers"
            )
        into.mkdir(parents=True, exist_ok=True)
        subprocess.run(["dpkg", "-x", str(deb), str(into)], check=True)


def _download(work: Path, options: list[str]) -> Path | None:
    """The package's .deb downloaded into ``work`` with apt-get ``options`` (none: the machine's own sources)."""
    if options:
        update = subprocess.run(["apt-get", *options, "update"], capture_output=True, text=True)
        if update.returncode:
            return None
    subprocess.run(["apt-get", *options, "download", DEBIAN_PACKAGE], cwd=work, capture_output=True, text=True)
    return next(work.glob(f"{DEBIAN_PACKAGE}_*.deb"), None)


def _trixie_options(work: Path) -> list[str]:
    """apt-get options that read Debian trixie's package lists into ``work`` only (the machine's apt is untouched)."""
    (work / "lists" / "partial").mkdir(parents=True)
    (work / "cache" / "archives" / "partial").mkdir(parents=True)
    (work / "trixie.sources").write_text(TRIXIE_SOURCES)
    return [
        "-o", f"Dir::Etc::sourcelist={work / 'trixie.sources'}",
        "-o", "Dir::Etc::sourceparts=-",
        "-o", f"Dir::State::Lists={work / 'lists'}",
        "-o", f"Dir::Cache={work / 'cache'}",
        "-o", "APT::Sandbox::User=root",
    ]  # fmt: skip


def build(quiet: bool = True, sanitize: bool = False) -> Path:
    """Configure and build the library (``sanitize``: the -fsanitize=address,undefined variant, into
    SANITIZED_DIR); returns its path (BuildFailed with the reason otherwise)."""
    for tool in ("cmake", "c++"):
        if not shutil.which(tool):
            raise BuildFailed(f"no {tool} on PATH")
    include = headers()
    out_dir = SANITIZED_DIR if sanitize else BUILD_DIR
    build_dir = out_dir / "cmake"
    out = subprocess.DEVNULL if quiet else None
    configure = ["cmake", "-S", str(SOURCE_DIR), "-B", str(build_dir), f"-DORT_INCLUDE_DIR={include}"]
    for command in (
        [*configure, f"-DDRAFTSMITH_SANITIZE={'ON' if sanitize else 'OFF'}"],
        ["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 1)],
    ):
        done = subprocess.run(command, stdout=out, stderr=subprocess.PIPE, text=True)
        if done.returncode:
            raise BuildFailed(f"{' '.join(command[:2])} failed:\n{done.stderr[-2000:]}")
    library = out_dir / LIBRARY_NAME
    staged = library.with_name(library.name + ".new")  # then renamed: a process that has the old one mapped keeps it
    shutil.copy2(build_dir / LIBRARY_NAME, staged)
    os.replace(staged, library)
    return library


def main() -> int:
    try:
        path = build(quiet="-v" not in sys.argv, sanitize="--sanitize" in sys.argv)
    except (BuildFailed, OSError, subprocess.CalledProcessError) as err:
        print(f"gguf kernels: not built ({err}); engines keep ONNX Runtime's MatMulNBits (slower)", file=sys.stderr)
        return 1
    if "--sanitize" in sys.argv:  # loads only into a process that preloads the sanitizer runtime
        print(f"gguf kernels: built the sanitizer variant {path}")
        return 0
    from runtime.engines import gguf_ops

    print(f"gguf kernels: built {path} ({gguf_ops.kernels()} kernels on this CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
