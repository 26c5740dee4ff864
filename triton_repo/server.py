"""Start a local ``tritonserver`` (the binary inside the ``nvidia-pytriton`` wheel) on a model repository.

Longer than most modules: starting, probing and stopping one tritonserver process (its paths, command line,
environment and restrictions) is one subject; the repository it serves is triton_repo/generate.py.

What it takes to run that binary outside NVIDIA's container (see FACTS.md, "A real Triton server on CPU"): the Python
backend's stub for the running Python version copied next to ``libtriton_python.so``, the wheel's
``nvidia_pytriton.libs`` on ``LD_LIBRARY_PATH``, and this interpreter's ``bin`` first on ``PATH`` so the models import
the same packages (numpy < 2) as this process. Every endpoint binds 127.0.0.1 unless told otherwise.

The server and its model processes get an allow-listed environment (``server_env``), not the caller's: a token or
key in the caller's environment never reaches code that reads requests. Its log survives a crash (``stop`` keeps it
when the server exited abnormally, or when asked to because its path was shown to someone).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
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
from typing import Iterable

# What the server and its models need from the environment: where programs, libraries and Python packages are, the
# locale, temporary files, thread and device settings. Nothing else (tokens, keys, passwords) is passed on.
PASSED_ENV = (
    "PATH",
    "LD_LIBRARY_PATH",
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONNOUSERSITE",
    "PYTHONDONTWRITEBYTECODE",
    "VIRTUAL_ENV",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LANGUAGE",
    "TZ",
    "TMPDIR",
    "TMP",
    "TEMP",
    "TOKENIZERS_PARALLELISM",
    "RAYON_NUM_THREADS",
)
PASSED_ENV_PREFIXES = ("LC_", "OMP_", "ORT_", "ONNXRUNTIME_", "MKL_", "OPENBLAS_", "CUDA_", "NVIDIA_", "CUDNN_")
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH", re.I)  # never passed by prefix (NVIDIA_API_KEY)
# Triton 2.51's restricted categories (--http-restricted-api / --grpc-restricted-protocol APIS:KEY=VALUE)
RESTRICTABLE = (
    "health",
    "metadata",
    "inference",
    "shared-memory",
    "model-config",
    "model-repository",
    "statistics",
    "trace",
    "logging",
)
_RESTRICTION = re.compile(r"([a-z-]+(?:,[a-z-]+)*):([A-Za-z0-9_-]+)=(\S+)")


IDLE_STOP_S = 3.0  # a drained server (no model loaded) gets this long to exit before its process group is killed


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
    paths = {
        "binary": root / "bin" / "tritonserver",
        "backends": root / "backends",
        "stub": root / "python_backend_stubs" / version / "triton_python_backend_stub",
        "libs": root.parent.parent / "nvidia_pytriton.libs",
    }
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
        shutil.copytree(
            paths["backends"] / "python", python, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
        )
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
    keep_log: bool = False  # keep the log even after a clean stop (its path was shown to someone)
    log_kept: bool = False  # set by stop(): the log is still at log_path
    exit_timeout: int = 10  # tritonserver's --exit-timeout-secs: how long a stop waits for in-flight requests
    drain_header: tuple[str, str] | None = None  # the model-repository API's header (drainable servers only)
    unloaded: bool = False  # set by drain(): every model unloaded (its requests finished) before the stop

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
        return _answers_200(f"{self.url}/v2/health/ready")

    def serving(self) -> bool:
        """Ready, and the metrics endpoint up too: tritonserver starts its metrics service after the HTTP one, so
        a client that reads /metrics right after /v2/health/ready can still be refused (seen on a busy machine)."""
        return self.ready() and _answers_200(self.metrics_url)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def drain(self, linger: float = 0.0) -> int | None:
        """Stop without losing a request (what a Kubernetes pod gets on SIGTERM); returns the exit code.

        Measured on tritonserver 2.51: signalled, it closes its listening ports at once (``/v2/health/*`` too) but
        keeps serving new requests on connections already open until ``--exit-timeout-secs``, then drops them,
        cutting any request still running. So a drainable server (``start_server(drainable=True)``) is first told
        to unload every model (the ensemble first): ``/v2/models/<model>/ready`` turns false at once, a new request
        is refused before any work (404 "unknown model"; Triton has no 503 for it), and each model unloads once its
        requests in flight have finished (up to ``exit_timeout`` seconds). Then, ``linger`` seconds after the call
        at the earliest, the server is signalled; with every model unloaded it has nothing left but the clients'
        idle connections, which it would hold open for its whole exit timeout, so it gets ``IDLE_STOP_S`` seconds
        before its process group is killed. A server that is not drainable only lingers, then stops.
        """
        deadline = time.monotonic() + linger
        unloaded = False
        if self.drain_header is not None and self.process.poll() is None:
            unloaded = self._unload_all(time.monotonic() + self.exit_timeout)
        self.unloaded = unloaded
        while time.monotonic() < deadline and self.process.poll() is None:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return self.stop(timeout=IDLE_STOP_S if unloaded else self.exit_timeout + 20.0)

    def _repository(self, path: str, body: dict | None = None) -> list | dict:
        """POST to the model-repository API with the drain header; [] when the server does not answer."""
        request = urllib.request.Request(
            f"{self.url}/v2/repository/{path}",
            data=json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json", self.drain_header[0]: self.drain_header[1]},
        )
        try:
            with urllib.request.urlopen(request, timeout=max(5, self.exit_timeout)) as response:
                text = response.read().decode()
        except (urllib.error.URLError, OSError):
            return []
        return json.loads(text) if text else {}

    def _unload_all(self, deadline: float) -> bool:
        """Unload every loaded model, ensembles first; True once none is loaded or unloading (False: ``deadline``
        came first, or the server stopped answering)."""
        models = [m for m in self._repository("index") if m.get("state") == "READY"]
        for model in sorted(models, key=lambda m: m["name"] != "ensemble"):
            self._repository(f"models/{model['name']}/unload")
        while time.monotonic() < deadline and self.process.poll() is None:
            index = self._repository("index")
            if index and not any(m.get("state") in ("READY", "UNLOADING") for m in index):
                return True
            time.sleep(0.1)
        return False

    def stop(self, timeout: float | None = None) -> int | None:
        """Stop the server (SIGINT, then SIGKILL to its process group after ``timeout``, by default the exit timeout
        and 20 s); returns its exit code.

        The log is removed only after a clean stop of a server that was running, unless ``keep_log``; after a crash
        (the server had exited by itself, or did not stop in time, or exited non-zero) it stays at ``log_path`` and
        ``log_kept`` says so.
        """
        crashed = self.process.poll() is not None
        if crashed:
            self._kill_group()  # model stubs a crashed server left behind
        else:
            self.process.send_signal(signal.SIGINT)  # graceful: Triton unloads models, stubs exit
            try:
                self.process.wait(self.exit_timeout + 20.0 if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                crashed = True
                self._kill_group()
                self.process.wait(10)
        clean = not crashed and self.process.returncode == 0
        self.log_kept = self.log_kept or self.keep_log or not clean
        for path in self._cleanup:
            if not (self.log_kept and self.log_path.is_relative_to(path)):
                shutil.rmtree(path, ignore_errors=True)
        self._cleanup.clear()
        return self.process.returncode

    def _kill_group(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # its own session: the server and its model stubs
        except (ProcessLookupError, PermissionError):
            pass  # nothing left of it

    def __enter__(self) -> "TritonServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def check_restriction(spec: str, flag: str) -> str:
    """``APIS:KEY=VALUE`` as Triton 2.51 takes it (e.g. ``model-repository,model-config:admin-key=SECRET``)."""
    match = _RESTRICTION.fullmatch(spec)
    unknown = [] if match is None else [a for a in match.group(1).split(",") if a not in RESTRICTABLE]
    if match is None or unknown:
        raise ServerError(
            f"{flag} {spec!r}: expected APIS:HEADER=VALUE, APIS a comma-separated list of "
            f"{', '.join(RESTRICTABLE)}" + (f" (unknown: {', '.join(unknown)})" if unknown else "")
        )
    return spec


def server_command(
    repo: Path,
    backends: Path,
    host: str,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    log_verbose: int = 0,
    http_restricted_api: Iterable[str] = (),
    grpc_restricted_protocol: Iterable[str] = (),
    exit_timeout: int = 10,
    explicit_models: bool = False,
) -> list[str]:
    """The tritonserver command line; each restriction makes its APIs answer only requests with its header;
    exit_timeout: seconds a stop waits for requests in flight (and open client streams); explicit_models: every
    model loaded at start, and unloadable through the model-repository API (restrict it)."""
    return (
        [
            str(tritonserver_paths()["binary"]),
            f"--model-repository={repo}",
            f"--backend-directory={backends}",
            f"--http-address={host}",
            f"--http-port={http_port}",
            f"--grpc-address={host}",
            f"--grpc-port={grpc_port}",
            f"--metrics-address={host}",
            f"--metrics-port={metrics_port}",
            "--allow-metrics=true",
            "--allow-gpu-metrics=false",
            "--allow-cpu-metrics=false",
            f"--log-verbose={log_verbose}",
            "--exit-on-error=true",
            "--disable-auto-complete-config",
            f"--exit-timeout-secs={exit_timeout}",
        ]  # the default, 30 s, is held by any open client stream
        + (["--model-control-mode=explicit", "--load-model=*"] if explicit_models else [])
        + [f"--http-restricted-api={check_restriction(s, '--http-restricted-api')}" for s in http_restricted_api]
        + [
            f"--grpc-restricted-protocol={check_restriction(s, '--grpc-restricted-protocol')}"
            for s in grpc_restricted_protocol
        ]
    )


def server_env(pass_env: Iterable[str] = ()) -> dict[str, str]:
    """The environment of the server and its model processes: the allow-list (``PASSED_ENV``, names starting with
    ``PASSED_ENV_PREFIXES``) and the names in ``pass_env``, never the caller's whole environment."""
    wanted = set(PASSED_ENV) | set(pass_env)
    env = {
        k: v
        for k, v in os.environ.items()
        if k in wanted or (k.startswith(PASSED_ENV_PREFIXES) and not SECRET_NAME.search(k))
    }
    libs = str(tritonserver_paths()["libs"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libs, env.get("LD_LIBRARY_PATH")) if p)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def start_server(
    repo: str | os.PathLike,
    *,
    host: str = "127.0.0.1",
    http_port: int = 0,
    grpc_port: int = 0,
    metrics_port: int = 0,
    timeout: float = 180.0,
    log_verbose: int = 0,
    log_path: str | os.PathLike | None = None,
    backends: str | os.PathLike | None = None,
    http_restricted_api: Iterable[str] = (),
    grpc_restricted_protocol: Iterable[str] = (),
    pass_env: Iterable[str] = (),
    keep_log: bool = False,
    exit_timeout: int = 10,
    drainable: bool = False,
) -> TritonServer:
    """Start tritonserver on ``repo`` and wait until it is ready.

    Args:
        repo: the model repository.
        host: the address every endpoint binds (127.0.0.1 by default; 0.0.0.0 exposes it to the network).
        http_port, grpc_port, metrics_port: 0 picks a free port.
        timeout: seconds to wait for readiness.
        log_verbose: tritonserver's --log-verbose.
        log_path: where the server's output goes (default: a temporary file, removed by a clean ``stop``; kept
            after a crash or a failed start, whose error names it).
        backends: a prepared backends folder (default: a temporary copy with this interpreter's Python stub).
        http_restricted_api, grpc_restricted_protocol: ``APIS:HEADER=VALUE`` groups (Triton's flags of these
            names): those APIs then answer only requests carrying that header (e.g.
            ``model-repository,model-config,statistics,trace,logging:admin-key=SECRET``). The value is visible in
            the server's command line to local users.
        pass_env: environment variable names to pass to the server and its models beyond ``PASSED_ENV``.
        keep_log: keep the log even after a clean stop (``draftsmith serve`` prints its path).
        exit_timeout: seconds a stop (``stop``, ``drain``) lets requests in flight finish.
        drainable: models in explicit control mode, so ``drain`` can unload them (the model-repository API is then
            restricted: by the caller's own ``http_restricted_api`` header when it covers model-repository, else by
            a random one only this TritonServer knows).

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
    http_restricted_api, drain_header = list(http_restricted_api), None
    if drainable:
        http_restricted_api, drain_header = _drain_restriction(http_restricted_api)
    http_restricted_api = restricted_by_default(http_restricted_api, "--http-restricted-api")
    grpc_restricted_protocol = restricted_by_default(list(grpc_restricted_protocol), "--grpc-restricted-protocol")
    command = server_command(
        repo,
        Path(backends),
        host,
        *ports,
        log_verbose=log_verbose,
        http_restricted_api=http_restricted_api,
        grpc_restricted_protocol=grpc_restricted_protocol,
        exit_timeout=exit_timeout,
        explicit_models=drainable,
    )
    env = server_env(pass_env)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = TritonServer(
        process,
        host,
        *ports,
        log_path=log_path,
        _cleanup=cleanup,
        keep_log=keep_log,
        exit_timeout=exit_timeout,
        drain_header=drain_header,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            why = _log_errors(server.log())
            server.stop()
            raise ServerError(f"tritonserver exited with {process.returncode}:\n{why}\n(full log: {log_path})")
        if server.serving():
            return server
        time.sleep(0.5)
    why = _log_errors(server.log())
    server.keep_log = True  # the error below points at it
    server.stop()
    raise ServerError(f"tritonserver was not ready after {timeout:.0f} s:\n{why}\n(full log: {log_path})")


def _drain_restriction(specs: list[str]) -> tuple[list[str], tuple[str, str]]:
    """The restrictions with model-repository covered, and the header that opens it: the caller's, when one of
    theirs covers it, else a random one added here (unloading models must not be open to every client)."""
    for spec in specs:
        match = _RESTRICTION.fullmatch(check_restriction(spec, "--http-restricted-api"))
        if "model-repository" in match.group(1).split(","):
            return specs, (match.group(2), match.group(3))
    header = ("draftsmith-drain", secrets.token_hex(16))
    return specs + [f"model-repository:{header[0]}={header[1]}"], header


CLOSED_BY_DEFAULT = ("shared-memory", "model-repository")  # a client could map memory, or load and unload models


def restricted_by_default(specs: list[str], flag: str) -> list[str]:
    """The restrictions with every CLOSED_BY_DEFAULT category the caller left open behind a random header nobody
    is told: the APIs a request-serving deployment never needs stay shut unless the caller opens them with a key of
    their own."""
    covered = {c for spec in specs for c in _RESTRICTION.fullmatch(check_restriction(spec, flag)).group(1).split(",")}
    missing = [c for c in CLOSED_BY_DEFAULT if c not in covered]
    if not missing:
        return specs
    return specs + [f"{','.join(missing)}:draftsmith-closed={secrets.token_hex(16)}"]


def _log_errors(log: str, limit: int = 4000) -> str:
    """The log's error lines (Triton prefixes them with E), which name the cause; else the log's tail."""
    errors = "\n".join(line for line in log.splitlines() if line.startswith("E"))
    return (errors or log)[-limit:]
