"""The memory of a server's process tree, read from /proc (Linux): tritonserver and its Python backend stubs are its
children, so what it holds is the sum over its descendants. Used by ``draftsmith load`` (bench/load.py).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (tritonserver's Python backend stubs are its children)."""
    tree, out, todo = _children(), [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(tree.get(current, []))
    return out


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and its descendants, in bytes (0 when it is gone)."""
    total = 0
    for p in process_tree(pid):
        try:
            for line in Path("/proc", str(p), "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def find_server_pid(http_port: int) -> int | None:
    """The tritonserver process serving HTTP on ``http_port`` (for ``--url``), from /proc."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            args = Path("/proc", entry, "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args and args[0].endswith(b"tritonserver") and f"--http-port={http_port}".encode() in args:
            return int(entry)
    return None


class RssSampler:
    """A server's resident memory (MiB) from /proc every half second while a load runs (bench/openai_load.py)."""

    def __init__(self, pid: int | None, every: float = 0.5):
        self.samples: list[tuple[float, float]] = []  # (seconds since start, MiB)
        self._stop = threading.Event()
        self._start = time.perf_counter()
        if pid is None:
            return
        self._status = Path(f"/proc/{pid}/status")
        if not self._status.is_file():
            raise ValueError(f"--pid {pid}: no such process here (the server must run on this machine)")
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        while True:
            try:
                line = next(ln for ln in self._status.read_text().splitlines() if ln.startswith("VmRSS:"))
                self.samples.append((time.perf_counter() - self._start, int(line.split()[1]) / 1024))
            except (OSError, StopIteration):
                return
            if self._stop.wait(every):
                return

    def stop(self) -> None:
        self._stop.set()
        if hasattr(self, "_thread"):
            self._thread.join()
