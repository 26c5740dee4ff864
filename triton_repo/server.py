"""Start a local ``tritonserver`` (the binary inside the ``nvidia-pytriton`` wheel) on a model repository.

What it takes to run that binary outside NVIDIA's container (see FACTS.md, "A real Triton server on CPU"): the Python
backend's stub for the running Python version copied next to ``libtriton_python.so``, the wheel's
``nvidia_pytriton.libs`` on ``LD_LIBRARY_PATH``, and this interpreter's ``bin`` first on ``PATH`` so the models import
the same packages (numpy < 2) as this process. Every endpoint binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


class ServerError(RuntimeError):
    """tritonserver could not be found, started, or did not become ready."""


def _pytriton_root() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("the tritonserver binary comes with nvidia-pytriton: pip install --no-deps nvidia-pytriton")
    return Path(next(iter(spec.submodule_search_locations)))


def tritonserver_paths() -> dict[str, Path]:
    """binary, the wheel's backends folder, the Python stub for this interpreter, and the bundled libraries."""
    root = _pytriton_root() / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    paths = {"binary": root / "bin" / "tritonserver", "backends": root / "backends",
             "stub": root / "python_backend_stubs" / version / "triton_python_backend_stub",
             "libs": root.parent.parent / "nvidia_pytriton.libs"}
    missing = [f"{k}: {v}" for k, v in paths.items() if not v.exists()]
    if missing:
        raise ServerError("nvidia-pytriton is incomplete for Python " + version + ": " + "; ".join(missing))
    return paths


def prepare_backends(dest: Path | None = None) -> Path:
    """A backends folder whose ``python`` backend has this interpreter's stub (the wheel ships stubs apart)."""
    paths = tritonserver_paths()
    dest = Path(dest or tempfile.mkdtemp(prefix="draftsmith-backends-"))
    python = dest / "python"
    if not (python / "triton_python_backend_stub").is_file():
        shutil.copytree(paths["backends"] / "python", python, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(paths["stub"], python / "triton_python_backend_stub")
        os.chmod(python / "triton_python_backend_stub", 0o755)
    return dest


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class TritonServer:
    """A running tritonserver. ``stop()`` ends it (and is safe to call twice)."""

    process: subprocess.Popen
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path
    _cleanup: list = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # graceful: Triton unloads models, stubs exit
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)  # its own session: the server and its model stubs
                self.process.wait(10)
        for path in self._cleanup:
            shutil.rmtree(path, ignore_errors=True)
        self._cleanup.clear()
        return self.process.returncode

    def __enter__(self) -> "TritonServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def server_command(repo: Path, backends: Path, host: str, http_port: int, grpc_port: int, metrics_port: int,
                   log_verbose: int = 0) -> list[str]:
    return [str(tritonserver_paths()["binary"]), f"--model-repository={repo}", f"--backend-directory={backends}",
            f"--http-address={host}", f"--http-port={http_port}", f"--grpc-address={host}",
            f"--grpc-port={grpc_port}", f"--metrics-address={host}", f"--metrics-port={metrics_port}",
            "--allow-metrics=true", "--allow-gpu-metrics=false", "--allow-cpu-metrics=false",
            f"--log-verbose={log_verbose}", "--exit-on-error=true", "--disable-auto-complete-config",
            "--exit-timeout-secs=10"]  # open client streams otherwise hold a shutdown for 30 s


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    libs = str(tritonserver_paths()["libs"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libs, env.get("LD_LIBRARY_PATH")) if p)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def start_server(repo: str | os.PathLike, *, host: str = "127.0.0.1", http_port: int = 0, grpc_port: int = 0,
                 metrics_port: int = 0, timeout: float = 180.0, log_verbose: int = 0,
                 log_path: str | os.PathLike | None = None, backends: str | os.PathLike | None = None,
                 ) -> TritonServer:
    """Start tritonserver on ``repo`` and wait until it is ready.

    Args:
        repo: the model repository.
        host: the address every endpoint binds (127.0.0.1 by default; 0.0.0.0 exposes it to the network).
        http_port, grpc_port, metrics_port: 0 picks a free port.
        timeout: seconds to wait for readiness.
        log_verbose: tritonserver's --log-verbose.
        log_path: where the server's output goes (default: a temporary file, removed by ``stop``).
        backends: a prepared backends folder (default: a temporary copy with this interpreter's Python stub).

    Returns:
        A ready TritonServer; call ``stop()`` (or use it as a context manager).

    Raises:
        ServerError: the binary is missing, the server exited, or it was not ready in time (the log tail says why).
    """
    repo = Path(repo).resolve()
    if not repo.is_dir():
        raise ServerError(f"no model repository at {repo}; write one with `draftsmith triton-repo BUNDLE {repo}`")
    cleanup = []
    if backends is None:
        backends = prepare_backends()
        cleanup.append(backends)
    if log_path is None:
        log_dir = Path(tempfile.mkdtemp(prefix="draftsmith-triton-log-"))
        cleanup.append(log_dir)
        log_path = log_dir / "tritonserver.log"
    log_path = Path(log_path)
    ports = [p or free_port(host) for p in (http_port, grpc_port, metrics_port)]
    command = server_command(repo, Path(backends), host, *ports, log_verbose=log_verbose)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=server_env(),
                                   start_new_session=True)
    server = TritonServer(process, host, *ports, log_path=log_path, _cleanup=cleanup)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            why = _log_errors(server.log())
            server.stop()
            raise ServerError(f"tritonserver exited with {process.returncode}:\n{why}")
        if server.ready():
            return server
        time.sleep(0.5)
    why = _log_errors(server.log())
    server.stop()
    raise ServerError(f"tritonserver was not ready after {timeout:.0f} s:\n{why}")


def _log_errors(log: str, limit: int = 4000) -> str:
    """The log's error lines (Triton prefixes them with E), which name the cause; else the log's tail."""
    errors = "\n".join(line for line in log.splitlines() if line.startswith("E"))
    return (errors or log)[-limit:]
