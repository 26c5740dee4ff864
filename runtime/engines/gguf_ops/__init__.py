"""Draftsmith's GGUF-block matmul for ONNX Runtime (``ai.draftsmith.GgufMatMul``): a native operator library that
multiplies by a GGUF file's own weight blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K), built by ``scripts/setup.sh``
from ``src/`` (C++17; AVX-512 VNNI, AVX2 and portable kernels, picked at run time).

ONNX Runtime's own MatMulNBits takes float32 scales and folds every zero point and K-quant minimum into float32 terms,
so it reads ~1.5x a Q4_K_M file's bytes a token and re-rounds Q6_K as 8-bit. This operator reads exactly the file's
blocks; the builder writes it where this library is built (``build-engines --gguf-kernel``) and keeps MatMulNBits
elsewhere. Its contract (src/ops.cpp): inputs A float [..., K] and one uint8 [rows, row_bytes] tensor per part (the
file's blocks for those output rows); attributes K, types (ggml type ids), rows; output float [..., sum(rows)].
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

DOMAIN = "ai.draftsmith"
OP = "GgufMatMul"
ATTENTION = "CausalAttention"  # GroupQueryAttention's work, the same for a query whatever its call (src/attention.cpp)
GATHER = "GgufGather"  # an embedding's rows from the file's bytes (a tied head's, shared): W, ids; K, type, layout
# ggml type ids (ggml.h enum ggml_type) of the types the operator multiplies
GGML_TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
# bytes of one block and values in it (ggml-common.h)
BLOCK_SHAPES = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q6_K": (256, 210),
}
LIBRARY_ENV = "DRAFTSMITH_GGUF_OPS"  # an explicit path to the library (else the one setup.sh built here)
BUILD_DIR = Path(__file__).with_name("build")
LIBRARY_NAME = "libdraftsmith_gguf_ops.so"
HOW_TO_BUILD = (
    "build it with `bash scripts/setup.sh` (or `python -m runtime.engines.gguf_ops.build`; needs a C++17 compiler "
    "and cmake)"
)
# What a node's attributes may describe (src/ops.cpp kMaxK, kMaxRows: the library refuses past them too), far past
# any model's: K the input width, rows the output rows of one node, all its parts together.
MAX_K = 1 << 20
MAX_ROWS = 1 << 24


def library_path() -> Path:
    """The library's one absolute path, the file checked, loaded and registered alike: $DRAFTSMITH_GGUF_OPS, else the
    build folder beside this module. Absolute because dlopen searches LD_LIBRARY_PATH and the system's folders for a
    name without a slash: a bare name checked in the working folder would not be the library loaded."""
    return _resolved(os.environ.get(LIBRARY_ENV) or "")


@functools.lru_cache(maxsize=None)
def _resolved(given: str) -> Path:
    """``given`` (empty: the build folder's library) as an absolute path, resolved once: a relative one against the
    working folder of the first look, so a later chdir does not name another file."""
    return Path(given or BUILD_DIR / LIBRARY_NAME).expanduser().resolve()


def _described(path: Path) -> str:
    """The library's path as a message names it: with the variable that gave it, as given, where one did."""
    given = os.environ.get(LIBRARY_ENV)
    return f"{path} (from {LIBRARY_ENV}={given})" if given else str(path)


@functools.lru_cache(maxsize=None)
def _load(path: str) -> tuple[ctypes.CDLL | None, str]:
    """The library at absolute ``path`` loaded (once), or None and why not."""
    try:
        library = ctypes.CDLL(path)
        library.RegisterCustomOps  # noqa: B018 (the entry point ONNX Runtime calls must be there)
        library.DraftsmithGgufKernels.restype = ctypes.c_char_p
        return library, ""
    except (OSError, AttributeError) as err:
        return None, str(err)


def unavailable_reason() -> str | None:
    """None where the library is built and loads here, else why not (and how to build it)."""
    path = library_path()
    if not path.is_file():
        return f"the GGUF kernel library is not built ({_described(path)} is missing); {HOW_TO_BUILD}"
    library, error = _load(str(path))
    if library is None:
        remedy = f"point {LIBRARY_ENV} at one built here or unset it" if os.environ.get(LIBRARY_ENV) else HOW_TO_BUILD
        return f"the GGUF kernel library at {_described(path)} does not load on this machine ({error}); {remedy}"
    return None


def available() -> bool:
    return unavailable_reason() is None


def native_for(kernel: str) -> bool:
    """Whether quant gguf engines are written for GgufMatMul under a preset's ``gguf_kernel`` (auto, native or
    matmulnbits: runtime.bundle.GGUF_KERNELS): the one rule the bundle's target engine and the distiller's teacher
    engine share, so the draft learns from the hidden states of the very kernel it will draft for."""
    return kernel == "native" or (kernel == "auto" and available())


def kernels() -> str | None:
    """The kernels this CPU runs ("avx512-vnni", "avx2" or "scalar"), or None without the library."""
    library = _load(str(library_path()))[0] if library_path().is_file() else None
    return library.DraftsmithGgufKernels().decode() if library is not None else None


def register(options) -> bool:
    """Register the operator on ONNX Runtime ``options`` where the library is here; False where it is not."""
    if not available():
        return False
    options.register_custom_ops_library(str(library_path()))
    return True
