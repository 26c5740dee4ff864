"""A bounded walk over a GGUF file's header, run before any GGUF parser sees the file.

``gguf.GGUFReader`` (and transformers, which uses it) trusts every count in the header: a tiny file declaring a
key-value array of 2^60 items makes it loop and allocate without bound. This walk reads the same structure (GGUF
version 2/3, ggml-org/llama.cpp ``docs/gguf.md`` and ``ggml/src/gguf.cpp``), checks every count and length against
the bytes left in the file before using it, and never allocates by a declared size::

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count x   (string key, u32 value_type, value)      string = u64 length + bytes; array = u32 type, u64 count
    tensor_count x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)
    padding to general.alignment (default 32), then the tensor data, each tensor at its offset

``read`` returns the tensors' names, types, shapes and data extents, which is all builder.gguf.weights needs: it
maps the data itself and skips GGUFReader's slow parse of the metadata (16 s for SmolLM2's vocabulary).

Limits beyond the file's size keep the parser's own per-item cost bounded (it builds a few numpy views per array
item): at most ``MAX_ARRAY_ITEMS`` items in one array and ``MAX_TOTAL_ITEMS`` in all (the largest real vocabularies
have ~262k tokens), names shorter than ggml's GGML_MAX_NAME (64), at most GGML_MAX_DIMS (4) dimensions.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_ARRAY_ITEMS = 1 << 21
MAX_TOTAL_ITEMS = 1 << 22
MAX_NAME = 64  # ggml GGML_MAX_NAME: tensor names are shorter
MAX_DIMS = 4  # ggml GGML_MAX_DIMS
MAX_NESTING = 2  # arrays of arrays, at most this deep
DEFAULT_ALIGNMENT = 32
# GGUF value types: scalar sizes; 8 = string, 9 = array
SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY, UINT32 = 8, 9, 4


class GGUFHeaderError(ValueError):
    """A GGUF file's header is truncated or inconsistent; the message names the field."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header declares it, checked to lie inside the file."""

    name: str
    kind: str  # the ggml type's name (gguf.GGMLQuantizationType), e.g. "Q4_K"
    shape: tuple[int, ...]  # GGUF order: ne0 (the contiguous axis, K of a weight) first
    start: int  # absolute byte offset of the data in the file
    nbytes: int


class _Walker:
    """Reads little-endian fields from ``data`` and refuses any that would run past its end."""

    def __init__(self, data, path: Path):
        self.data, self.path, self.pos, self.items = data, path, 0, 0

    def fail(self, what: str):
        raise GGUFHeaderError(
            f"{self.path.name}: not a valid GGUF file: {what} (at byte {self.pos} of {len(self.data)})"
        )

    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, size: int, what: str) -> int:
        if size > self.left():
            self.fail(f"{what} needs {size} bytes but only {self.left()} remain (truncated or corrupt)")
        start = self.pos
        self.pos += size
        return start

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.data, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.data, self.take(8, what))[0]

    def string(self, what: str, limit: int | None = None) -> bytes:
        length = self.u64(what + " length")
        if limit is not None and length >= limit:
            self.fail(f"{what} is {length} bytes long; at most {limit - 1} are allowed")
        start = self.take(length, f"{what} ({length} bytes)")
        return bytes(self.data[start : start + length])

    def count(self, n: int, min_size: int, what: str) -> int:
        """``n`` items of at least ``min_size`` bytes each must fit in what is left."""
        if n * min_size > self.left():
            self.fail(f"{what} declares {n} items of at least {min_size} bytes but only {self.left()} bytes remain")
        return n


@dataclass(frozen=True)
class GgufFile:
    """A GGUF file whose whole header was walked and checked, with the tensors it declares: read once, when the
    checkpoint is resolved (builder.checkpoint), and handed on as data to what maps the file's blocks
    (builder.gguf.weights), which need not walk the header again."""

    path: Path
    tensors: dict[str, TensorInfo]


def open_gguf(path: Path) -> GgufFile:
    """``path`` with its tensors, once its whole header (and every tensor's data extent) is consistent
    (GGUFHeaderError otherwise)."""
    return GgufFile(Path(path), read(path))


def read(path: Path) -> dict[str, TensorInfo]:
    """The tensors ``path`` declares, by name, once its whole header has been checked (GGUFHeaderError otherwise).
    Cheap where gguf.GGUFReader is not: it skips the metadata values (vocabularies) instead of parsing them."""
    path = Path(path)
    with open(path, "rb") as handle:
        if path.stat().st_size == 0:
            raise GGUFHeaderError(f"{path.name}: not a valid GGUF file: it is empty")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _walk(_Walker(data, path))


def _walk(w: _Walker) -> dict[str, TensorInfo]:
    magic = bytes(w.data[w.take(4, "magic") : w.pos])
    if magic != MAGIC:
        w.pos = 0
        w.fail(f"magic is {magic!r}, not {MAGIC!r}")
    version = w.u32("version")
    if version not in VERSIONS:
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        w.fail(f"version {version} is not one of {VERSIONS}{hint}")
    tensors = w.u64("tensor_count")
    kvs = w.u64("kv_count")
    w.count(kvs, 8 + 4 + 1, "kv_count")
    alignment = DEFAULT_ALIGNMENT
    keys = set()
    for i in range(kvs):
        key = _text(w, w.string(f"key-value {i}'s key"), f"key-value {i}'s key")
        if key in keys:
            w.fail(f"key {key!r} appears twice")
        keys.add(key)
        kind = w.u32(f"{key!r}'s value type")
        if key == "general.alignment":
            if kind != UINT32:
                w.fail(f"general.alignment has value type {kind}, not uint32")
            alignment = w.u32("general.alignment")
            if alignment == 0 or alignment & (alignment - 1):
                w.fail(f"general.alignment {alignment} is not a power of two")
        else:
            _value(w, kind, repr(key), 0)
    w.count(tensors, 8 + 4 + 4 + 8, "tensor_count")
    infos = [_tensor_info(w, i) for i in range(tensors)]
    named = {info[0]: info for info in infos}
    if len(named) != len(infos):
        w.fail("two tensors have the same name")
    return _check_data(w, infos, w.pos + (-w.pos) % alignment, alignment)


def _text(w: _Walker, raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        w.fail(f"{what} is not UTF-8")


def _value(w: _Walker, kind: int, what: str, depth: int) -> None:
    if kind in SCALARS:
        w.take(SCALARS[kind], what)
    elif kind == STRING:
        length = w.u64(what + " length")
        w.take(length, f"{what} ({length} bytes)")
    elif kind == ARRAY:
        item = w.u32(f"{what}'s array item type")
        n = w.u64(f"{what}'s array count")
        if n > MAX_ARRAY_ITEMS:
            w.fail(f"{what} declares an array of {n} items; at most {MAX_ARRAY_ITEMS} are allowed")
        w.items += n
        if w.items > MAX_TOTAL_ITEMS:
            w.fail(f"the arrays hold more than {MAX_TOTAL_ITEMS} items in all (at {what})")
        if item in SCALARS:
            w.take(w.count(n, SCALARS[item], what) * SCALARS[item], f"{what}'s {n} items")
        elif item == STRING:
            _skip_strings(w, w.count(n, 8, what), what)
        elif item == ARRAY and depth + 1 < MAX_NESTING:
            w.count(n, 12, what)
            for j in range(n):
                _value(w, ARRAY, f"{what}[{j}]", depth + 1)
        else:
            w.fail(f"{what} is an array of unsupported item type {item}")
    else:
        w.fail(f"{what} has unknown value type {kind}")


def _skip_strings(w: _Walker, n: int, what: str) -> None:
    """Past ``n`` strings, each length checked before it is used (a tight loop: vocabularies have ~262k)."""
    data, pos, end = w.data, w.pos, len(w.data)
    length_at = struct.Struct("<Q").unpack_from
    for j in range(n):  # noqa: B007 (j names the string that runs past the end, after the loop)
        if pos + 8 > end:
            break
        pos += 8 + length_at(data, pos)[0]
        if pos > end:
            break
    else:
        w.pos = pos
        return
    w.pos = min(pos, end)
    w.fail(f"{what}[{j}] runs past the end of the file (truncated or corrupt)")


def _tensor_info(w: _Walker, i: int) -> tuple[str, int, tuple[int, ...], int]:
    """(name, ggml type, shape, offset) of tensor ``i``; dims checked against ggml's limits."""
    name = _text(w, w.string(f"tensor {i}'s name", MAX_NAME), f"tensor {i}'s name")
    dims = w.u32(f"tensor {name!r}'s n_dims")
    if not 1 <= dims <= MAX_DIMS:
        w.fail(f"tensor {name!r} has {dims} dimensions; 1 to {MAX_DIMS} are allowed")
    shape = tuple(w.u64(f"tensor {name!r}'s dimension {d}") for d in range(dims))
    kind = w.u32(f"tensor {name!r}'s type")
    offset = w.u64(f"tensor {name!r}'s data offset")
    return name, kind, shape, offset


def _check_data(w: _Walker, infos, start: int, alignment: int) -> dict[str, TensorInfo]:
    """Every tensor of a known type lies inside the file, at an aligned offset, its rows whole blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    available = len(w.data) - start
    tensors = {}
    for name, kind, shape, offset in infos:
        try:
            kind = GGMLQuantizationType(kind)
            block, size = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            w.fail(f"tensor {name!r} has unknown type {kind}")
        if shape[0] % block:
            w.fail(f"tensor {name!r}'s rows ({shape[0]}) are not whole {kind.name} blocks of {block}")
        elements = 1
        for length in shape:
            elements *= length
        nbytes = elements // block * size
        if offset % alignment or offset + nbytes > available:
            w.fail(
                f"tensor {name!r}'s data ({nbytes} bytes at offset {offset}) is misaligned or runs past the end "
                f"of the file ({available} data bytes)"
            )
        tensors[name] = TensorInfo(name, kind.name, shape, start + offset, nbytes)
    return tensors
