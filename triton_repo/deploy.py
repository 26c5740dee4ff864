"""``draftsmith deploy kubernetes BUNDLE --out DIR``: plain Kubernetes manifests (kustomize-ready) serving a bundle.

Longer than most modules: one manifest set (Deployment, Service, PDB, HPA and their sizing) is one subject;
the drain it relies on is runtime/serving/drain.py and triton_repo/server.py.

Written for either server: ``openai`` (``draftsmith serve-openai``) or, for a tensorrt_llm bundle, ``triton``
(tritonserver under mpirun in NVIDIA's Triton TRT-LLM image, a release with the fixes of NVIDIA's August 2025
bulletin). ``triton`` is refused for an ONNX Runtime bundle: the CPU image's tritonserver is the nvidia-pytriton
wheel's 2.51, whose HTTP front has unauthenticated crash/RCE CVEs (docs/operations.md, "Security"), and a
deployment must not put it on a pod's network; ``openai`` serves the same bundle. Every pod runs under Pod Security
"restricted" without a service-account token, a NetworkPolicy admits only the serving ports from the namespace, and
the API key comes from a Secret mounted as a file. What each manifest takes from the bundle and from a measurement:

- readiness: the server's own (the OpenAI server's ``/health``: 503 while its scheduler is down or while draining;
  Triton's ``/v2/health/ready``); liveness: ``/health/live`` / ``/v2/health/live``; a startup probe allowing three
  times the measured load time (plus 30 s) before liveness starts;
- resources: CPU from the thread count; memory from the measured peak of one server process plus the KV caches of a
  full batch (``max_batch`` rows of the bundle's context, target and draft);
- ``terminationGracePeriodSeconds``: the longest request the server allows (its max_tokens limit) at a full batch's
  per-row speed (measured), times 1.5, plus the drain's linger and 15 s for the process to stop; the server's drain
  timeout (``--drain-timeout`` / Triton's ``--exit-timeout-secs``) is that less the 15 s;
- the bundle read-only: a PersistentVolumeClaim (``--bundle-source pvc``) or an init container that copies it from
  an image holding it at /bundle (``--bundle-source image``); the server verifies it at start as ever;
- a Service, a PodDisruptionBudget, and a HorizontalPodAutoscaler on CPU (``hpa-cpu.yaml``) or on the queue length
  (``hpa-queue.yaml``, for clusters with a custom-metrics adapter: ``vllm:num_requests_waiting`` for the OpenAI
  server, Triton's ``nv_inference_pending_request_count``); both are written, the kustomization lists the one
  ``--autoscale`` names;
- tensorrt_llm bundles: ``nvidia.com/gpu`` limits of tp x pp (the bundle's manifest) and the launch command of
  ``trtllm_launch_command``.

Measurement (``measure``) loads an ONNX Runtime bundle in a child process; a tensorrt_llm bundle cannot be loaded
without a GPU, so its figures are estimates from its size unless given (``--load-seconds``, ``--memory-mib``,
``--tokens-per-second``).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import click
import yaml

from runtime.bundle import BundleError, Manifest, load_manifest

SERVERS = ("openai", "triton")
BUNDLE_SOURCES = ("pvc", "image")
AUTOSCALERS = ("cpu", "queue")
BUNDLE_PATH, WORK_PATH = "/bundle", "/work"
HTTP_PORT, GRPC_PORT, METRICS_PORT = 8000, 8001, 8002
HEALTH_PORT = 8003  # serve-openai --health-port: the probes' own port, which no client's connections can starve
PROCESS_STOP_S = 15  # after the drain: uvicorn's graceful close (5 s), the scheduler and interpreter teardown
# The image NVIDIA publishes with tritonserver and the TensorRT-LLM backend (NGC, nvcr.io/nvidia/tritonserver,
# tag <yy.mm>-trtllm-python-py3); pick the release whose TensorRT-LLM built the bundle (docs/tensorrt_llm.md).
TRTLLM_TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:25.10-trtllm-python-py3"
# NVIDIA's August 2025 bulletin (CVE-2025-23310/23311: chunked-encoding stack overflow; 23319/23320/23334: Python
# backend shared memory to RCE) is fixed from release 25.07 (tritonserver 2.59.1); older NGC tags are refused.
FIRST_FIXED_TRITON = (25, 7)
NGC_TRITON_TAG = re.compile(r"nvcr\.io/nvidia/tritonserver:(\d{2})\.(\d{2})(?:[-.].*)?")
API_KEY_DIR = "/run/secrets/draftsmith"  # the Secret's volume; the server reads the key from a file there
TRITONSERVER = "/opt/tritonserver/bin/tritonserver"  # its path in that image


class DeployError(ValueError):
    """An option or a bundle does not make a deployment; the message says which and why."""


@dataclass(frozen=True)
class Measured:
    """What sizes the probes, the resources and the grace period: one server process's figures."""

    load_s: float  # process start to serving (imports, bundle verification, engine sessions, calibration)
    rss_mib: float  # peak resident memory after loading and one request
    tokens_per_s: float  # one request alone, decode speed
    how: str  # "measured" or "estimated: ..."


@dataclass(frozen=True)
class DeployOptions:
    """The deployment's choices (``draftsmith deploy kubernetes --help`` says each)."""

    server: str = "openai"
    name: str = "draftsmith"
    image: str = "draftsmith:cpu"
    replicas: int = 2
    threads: int = 2
    max_batch: int = 8
    max_queue: int = 256
    policy: str = "exact"
    bundle_source: str = "pvc"
    bundle_pvc: str = "draftsmith-bundle"
    bundle_image: str = ""
    autoscale: str = "cpu"
    min_replicas: int = 2
    max_replicas: int = 8
    cpu_utilization: int = 70  # percent of the CPU request
    queue_per_replica: int = 4  # waiting requests per replica the queue autoscaler aims at
    drain_linger: float = 5.0  # seconds of 503s after SIGTERM: endpoint removal reaching every node
    api_key_secret: str = ""  # a Secret with key DRAFTSMITH_API_KEY, mounted as a file (openai); "": no key
    triton_image: str = TRTLLM_TRITON_IMAGE
    upstream_models: str = ""  # tensorrt_llm + triton: upstream's model folder inside the image ("": declared configs)

    def __post_init__(self) -> None:
        problems = []
        for name, allowed in (("server", SERVERS), ("bundle_source", BUNDLE_SOURCES), ("autoscale", AUTOSCALERS)):
            if getattr(self, name) not in allowed:
                problems.append(f"{name}: expected one of {allowed}, received {getattr(self, name)!r}")
        for name in (
            "replicas",
            "threads",
            "max_batch",
            "max_queue",
            "min_replicas",
            "max_replicas",
            "queue_per_replica",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name}: expected an integer >= 1, received {value!r}")
        if not problems and self.max_replicas < self.min_replicas:
            problems.append(
                f"max_replicas: expected >= min_replicas ({self.min_replicas}), received {self.max_replicas}"
            )
        if not 1 <= self.cpu_utilization <= 100:
            problems.append(f"cpu_utilization: expected a percentage in [1, 100], received {self.cpu_utilization!r}")
        if not self.drain_linger >= 0:
            problems.append(f"drain_linger: expected seconds >= 0, received {self.drain_linger!r}")
        if self.bundle_source == "image" and not self.bundle_image:
            problems.append(
                "bundle_image: --bundle-source image needs --bundle-image (an image holding the bundle at /bundle)"
            )
        if not _dns_label(self.name):
            problems.append(
                f"name: expected a DNS label (lower-case letters, digits, '-'; at most 40), received {self.name!r}"
            )
        if problems:
            raise DeployError("; ".join(problems))


def _dns_label(name: str) -> bool:
    return (
        isinstance(name, str)
        and 0 < len(name) <= 40
        and name[0].isalpha()
        and name[-1].isalnum()
        and all(c.islower() or c.isdigit() or c == "-" for c in name)
    )


# --- measurement ---------------------------------------------------------------------------------------------------


def measure(
    bundle: str | os.PathLike, threads: int, max_batch: int, policy: str = "exact", timeout: float = 600.0
) -> Measured:
    """Load ``bundle`` in a child process as the OpenAI server does (generator and scheduler), run one request, and
    report the load time, the peak RSS and the decode speed. ONNX Runtime bundles only."""
    command = [
        sys.executable,
        "-c",
        "import sys, json; from triton_repo.deploy import _measure_here; "
        "print(json.dumps(_measure_here(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])))",
        str(bundle),
        str(threads),
        str(max_batch),
        policy,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=env, cwd=Path(__file__).resolve().parents[1]
    )
    if done.returncode != 0:
        raise DeployError(f"measuring {bundle} failed:\n{done.stderr[-2000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    return Measured(**figures, how="measured")


def _measure_here(bundle: str, threads: int, max_batch: int, policy: str) -> dict:
    """The child's side of ``measure``."""
    import time

    start = time.perf_counter()
    from runtime.api import SpeculativeGenerator
    from runtime.metrics import peak_rss_bytes
    from runtime.serving.scheduler import Scheduler

    generator = SpeculativeGenerator.from_bundle(bundle, threads=threads)
    scheduler = Scheduler(generator, max_batch=max_batch, policy=policy).start()
    load_s = time.perf_counter() - start
    scheduler.stop()
    generator.generate("The quick brown fox", max_new_tokens=4)  # warm-up
    result = generator.generate("The quick brown fox", max_new_tokens=32)
    return {
        "load_s": round(load_s, 2),
        "rss_mib": round(peak_rss_bytes() / 2**20, 1),
        "tokens_per_s": round(result.stats.tokens_per_second, 1),
    }


def estimate_trtllm(bundle: Path, manifest: Manifest) -> Measured:
    """Figures for a tensorrt_llm bundle, which cannot be loaded here: conservative guesses from its size."""
    size_mib = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file()) / 2**20
    return Measured(
        load_s=120 + size_mib / 200,
        rss_mib=4096 + size_mib,
        tokens_per_s=20.0,
        how="estimated: 120 s + 1 s per 200 MiB to load, 4 GiB + the bundle's size of host memory, "
        "20 tokens/s per request (pass --load-seconds, --memory-mib, --tokens-per-second)",
    )


# --- sizing -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizing:
    """Everything the manifests take from the bundle and the measurement."""

    max_tokens: int  # the longest request the server allows
    drain_timeout_s: int
    grace_s: int
    startup_failures: int  # startup probe failureThreshold at STARTUP_PERIOD_S
    cpu_request_m: int
    cpu_limit_m: int
    memory_request_mib: int
    memory_limit_mib: int
    gpus: int  # nvidia.com/gpu per pod (0: none)


STARTUP_PERIOD_S = 5


def kv_cache_mib(manifest: Manifest, rows: int) -> float:
    """Target and draft caches (keys and values) for ``rows`` sequences of the bundle's context."""
    width = 2 if manifest.spec.device == "cuda" else 4  # fp16 on CUDA, fp32 on the CPU
    per_token = sum(2 * e.num_layers * e.num_kv_heads * e.head_dim * width for e in (manifest.target, manifest.draft))
    return rows * manifest.max_context * per_token / 2**20


def max_tokens_allowed(manifest: Manifest) -> int:
    """The largest max_tokens a request may ask of either server with its default limits (the front door's)."""
    from runtime.request import Limits

    return Limits.for_context(manifest.max_context).max_tokens_limit


def size(manifest: Manifest, measured: Measured, options: DeployOptions) -> Sizing:
    max_tokens = max_tokens_allowed(manifest)
    per_row = measured.tokens_per_s / options.max_batch  # a full batch shares each step (pessimistic)
    drain = max(30, math.ceil(1.5 * max_tokens / per_row + options.drain_linger))
    cpu = 1000 * options.threads + 250  # the engines' threads, the HTTP server and tokenizer
    memory = math.ceil((measured.rss_mib + kv_cache_mib(manifest, options.max_batch)) * 1.2 + 128)
    startup = math.ceil((3 * measured.load_s + 30) / STARTUP_PERIOD_S)
    gpus = manifest.spec.tp_size * manifest.spec.pp_size if manifest.spec.backend == "tensorrt_llm" else 0
    return Sizing(
        max_tokens=max_tokens,
        drain_timeout_s=drain,
        grace_s=drain + PROCESS_STOP_S,
        startup_failures=startup,
        cpu_request_m=cpu,
        cpu_limit_m=cpu + 1000,
        memory_request_mib=memory,
        memory_limit_mib=math.ceil(memory * 1.5),
        gpus=gpus,
    )


# --- commands -----------------------------------------------------------------------------------------------------


def trtllm_launch_command(manifest: Manifest, repo: str, exit_timeout_s: int) -> tuple[list[str], dict[str, str]]:
    """(command, environment) starting tritonserver on a tensorrt_llm repository, as PID 1 of a container.

    Derived from TensorRT-LLM's ``triton_backend/scripts/launch_triton_server.py`` (``get_cmd``; release 1.2): that
    script builds an ``mpirun`` line and returns at once (``subprocess.Popen``), so it cannot be a container's main
    process; this is its line. Engine flavor: two TensorRT-LLM models (draft and target), so ``--multi-model`` in its
    spawning orchestrator mode (world size 1, ``TRTLLM_ORCHESTRATOR=1``; each model's tp x pp ranks are spawned on
    the pod's GPUs) with the memory-pool flags it adds on Triton >= 24.06. LLM-API flavor: one rank; the LLM API
    starts its own tp x pp workers.
    """
    command = [
        "mpirun",
        "--allow-run-as-root",
        "-n",
        "1",
        TRITONSERVER,
        f"--model-repository={repo}",
        f"--exit-timeout-secs={exit_timeout_s}",
        f"--grpc-port={GRPC_PORT}",
        f"--http-port={HTTP_PORT}",
        f"--metrics-port={METRICS_PORT}",
    ]
    env = {}
    if manifest.spec.trtllm_flavor != "llmapi":
        gpus = manifest.spec.tp_size * manifest.spec.pp_size
        command += [
            "--pinned-memory-pool-byte-size=0",
            "--enable-peer-access=false",
            *[f"--cuda-memory-pool-byte-size={gpu}:0" for gpu in range(gpus)],
        ]
        env = {"TRTLLM_ORCHESTRATOR": "1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1"}
    command += ["--disable-auto-complete-config", "--backend-config=python,shm-region-prefix-name=prefix0_"]
    return command, env


def openai_command(options: DeployOptions, sizing: Sizing) -> list[str]:
    command = [
        "draftsmith",
        "serve-openai",
        BUNDLE_PATH,
        "--host",
        "0.0.0.0",
        "--port",
        str(HTTP_PORT),
        "--threads",
        str(options.threads),
        "--max-batch",
        str(options.max_batch),
        "--max-queue",
        str(options.max_queue),
        "--policy",
        options.policy,
        "--model-name",
        options.name,
        "--drain-timeout",
        str(sizing.drain_timeout_s),
        "--drain-linger",
        str(options.drain_linger),
        "--request-timeout",
        str(sizing.drain_timeout_s - options.drain_linger),  # no request outlives a drain
        "--health-port",
        str(HEALTH_PORT),
    ]
    if options.api_key_secret:
        command += ["--api-key-file", f"{API_KEY_DIR}/DRAFTSMITH_API_KEY"]
    return command


def trtllm_repo_command(options: DeployOptions) -> list[str]:
    """The tensorrt_llm repository (triton_repo/trtllm/layouts.py), engine paths as the pod sees the bundle."""
    return [
        "python3",
        "-c",
        "import sys; from triton_repo.trtllm.layouts import write_trtllm_repository as w; "
        "w(sys.argv[1], sys.argv[2], upstream_models=sys.argv[3] or None)",
        BUNDLE_PATH,
        f"{WORK_PATH}/repo",
        options.upstream_models,
    ]


def check_server(manifest: Manifest, options: DeployOptions) -> None:
    """Refuse a deployment that would expose a tritonserver with known unauthenticated CVEs: Triton on an ONNX
    Runtime bundle (the image's nvidia-pytriton 2.51), or an NGC Triton image older than ``FIRST_FIXED_TRITON``."""
    if options.server != "triton":
        return
    if manifest.spec.backend != "tensorrt_llm":
        raise DeployError(
            "--server triton on an ONNX Runtime bundle is refused: the image's tritonserver is nvidia-pytriton "
            "0.7.0's 2.51, whose HTTP front has unauthenticated crash and remote-code-execution CVEs "
            "(CVE-2025-23310, CVE-2025-23311; the Python backend's CVE-2025-23319/23320/23334), fixed only in 2.59.1 "
            "(NGC 25.07), and a pod would put it on the cluster network. Deploy the same bundle with --server openai "
            "(draftsmith serve-openai: the same scheduler, with an API key); keep draftsmith serve (Triton) on "
            '127.0.0.1 for development (docs/operations.md, "Security").'
        )
    tag = NGC_TRITON_TAG.fullmatch(options.triton_image)
    if tag and (int(tag[1]), int(tag[2])) < FIRST_FIXED_TRITON:
        raise DeployError(
            f"--triton-image {options.triton_image}: Triton releases before 25.07 have unauthenticated "
            "crash/RCE CVEs (NVIDIA's August 2025 bulletin: CVE-2025-23310 and others); use 25.07 or "
            "later, built with the bundle's TensorRT-LLM"
        )


# --- manifests ----------------------------------------------------------------------------------------------------


def manifests(bundle: str | os.PathLike, options: DeployOptions, measured: Measured | None = None) -> dict[str, dict]:
    """File name -> Kubernetes object, for ``bundle``; ``measured``: None measures it (``measure``, or
    ``estimate_trtllm`` for a tensorrt_llm bundle)."""
    root = Path(bundle)
    try:
        manifest = load_manifest(root)
    except BundleError as err:
        raise DeployError(str(err)) from None
    check_server(manifest, options)  # before measuring, which loads the bundle
    trtllm = manifest.spec.backend == "tensorrt_llm"
    if measured is None:
        measured = (
            estimate_trtllm(root, manifest)
            if trtllm
            else measure(root, options.threads, options.max_batch, options.policy)
        )
    sizing = size(manifest, measured, options)
    labels = {"app.kubernetes.io/name": "draftsmith", "app.kubernetes.io/instance": options.name}
    files = {
        "deployment.yaml": deployment(manifest, options, sizing, measured, labels),
        "service.yaml": service(options, labels),
        "pdb.yaml": {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": options.name, "labels": labels},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels}},
        },
        "hpa-cpu.yaml": autoscaler(options, labels, _cpu_metric(options)),
        "hpa-queue.yaml": autoscaler(options, labels, _queue_metric(options, trtllm)),
        "networkpolicy.yaml": network_policy(options, labels),
    }
    return files


def deployment(manifest: Manifest, options: DeployOptions, sizing: Sizing, measured: Measured, labels: dict) -> dict:
    trtllm = manifest.spec.backend == "tensorrt_llm"
    bundle_volume = (
        {"name": "bundle", "persistentVolumeClaim": {"claimName": options.bundle_pvc, "readOnly": True}}
        if options.bundle_source == "pvc"
        else {"name": "bundle", "emptyDir": {}}
    )
    volumes = [bundle_volume, {"name": "work", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    init = []
    if options.bundle_source == "image":
        init.append(
            _container(
                "copy-bundle",
                options.bundle_image,
                ["cp", "-R", f"{BUNDLE_PATH}/.", "/mnt/bundle/"],
                [{"name": "bundle", "mountPath": "/mnt/bundle"}],
                _small_resources(),
            )
        )
    mounts = [
        {"name": "bundle", "mountPath": BUNDLE_PATH, "readOnly": True},
        {"name": "work", "mountPath": WORK_PATH},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if options.server == "triton":
        init.append(_container("triton-repo", options.image, trtllm_repo_command(options), mounts, _small_resources()))
    server = server_container(manifest, options, sizing, mounts)
    if options.api_key_secret:  # a file in a Secret's volume: not in the environment, which /proc and logs show
        volumes.append(
            {
                "name": "api-key",
                "secret": {
                    "secretName": options.api_key_secret,
                    "defaultMode": 0o440,
                    "items": [{"key": "DRAFTSMITH_API_KEY", "path": "DRAFTSMITH_API_KEY"}],
                },
            }
        )
        server["volumeMounts"] = mounts + [{"name": "api-key", "mountPath": API_KEY_DIR, "readOnly": True}]
    # Pod Security "restricted" for every pod; NVIDIA's Triton image runs as any user (mpirun's
    # --allow-run-as-root is then moot). No service-account token: the server never calls the Kubernetes API.
    pod = {
        "terminationGracePeriodSeconds": sizing.grace_s,
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "fsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "initContainers": init,
        "containers": [server],
        "volumes": volumes,
    }
    if trtllm:
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    if not init:
        del pod["initContainers"]
    annotations = {
        "draftsmith/bundle-backend": manifest.spec.backend,
        "draftsmith/sizing": json.dumps({**asdict(sizing), **asdict(measured)}, sort_keys=True),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": options.name, "labels": labels, "annotations": annotations},
        "spec": {
            "replicas": options.replicas,
            "selector": {"matchLabels": labels},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }


def server_container(manifest: Manifest, options: DeployOptions, sizing: Sizing, mounts: list[dict]) -> dict:
    """The serving container: its command, environment, ports and probes (``deployment`` adds the key's volume)."""
    triton = options.server == "triton"  # only on tensorrt_llm bundles (check_server)
    env = {"OMP_NUM_THREADS": str(options.threads), "TOKENIZERS_PARALLELISM": "false", "HOME": WORK_PATH}
    if triton:
        command, launch_env = trtllm_launch_command(manifest, f"{WORK_PATH}/repo", sizing.drain_timeout_s)
        env.update(launch_env)
    else:
        command = openai_command(options, sizing)
    server = _container(
        "server", options.triton_image if triton else options.image, command, mounts, _resources(sizing)
    )
    server["env"] = [{"name": k, "value": v} for k, v in env.items()]
    server["ports"] = [
        {"name": name, "containerPort": port, "protocol": "TCP"} for name, port in serving_ports(options)
    ]
    ready, live = ("/v2/health/ready", "/v2/health/live") if triton else ("/health", "/health/live")
    # the OpenAI server answers its probes on a port of their own (not in the Service: the kubelet calls it)
    port = "http" if triton else "health"
    if not triton:
        server["ports"].append({"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"})
    server["startupProbe"] = _probe(live, STARTUP_PERIOD_S, sizing.startup_failures, port)
    # 3 failures: a busy pod is not flapped out; a stopping one leaves the Service's endpoints at once anyway
    server["readinessProbe"] = _probe(ready, 2, 3, port)
    server["livenessProbe"] = _probe(live, 10, 3, port)
    if triton and options.drain_linger > 0:  # mpirun hands SIGTERM to tritonserver, which closes its ports at once
        server["lifecycle"] = {"preStop": {"sleep": {"seconds": math.ceil(options.drain_linger)}}}
    return server


def serving_ports(options: DeployOptions) -> list[tuple[str, int]]:
    """(name, port) of what the pod serves: the Service's ports and the only ones its NetworkPolicy admits."""
    if options.server == "triton":
        return [("http", HTTP_PORT), ("grpc", GRPC_PORT), ("metrics", METRICS_PORT)]
    return [("http", HTTP_PORT)]


def network_policy(options: DeployOptions, labels: dict) -> dict:
    """Ingress to the serving ports from pods of the same namespace only, and no egress at all (the server calls
    nothing; kubelet probes come from the node, which policies do not govern). Add the namespace of your ingress
    controller or Prometheus to ``from`` if they live elsewhere (docs/operations.md)."""
    ports = [{"protocol": "TCP", "port": name} for name, _ in serving_ports(options)]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": options.name, "labels": labels},
        "spec": {
            "podSelector": {"matchLabels": labels},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"podSelector": {}}], "ports": ports}],
            "egress": [],
        },
    }


def _container(name: str, image: str, command: list[str], mounts: list[dict], resources: dict) -> dict:
    return {
        "name": name,
        "image": image,
        "command": command,
        "volumeMounts": mounts,
        "resources": resources,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def _small_resources() -> dict:
    return {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}


def _resources(sizing: Sizing) -> dict:
    resources = {
        "requests": {"cpu": f"{sizing.cpu_request_m}m", "memory": f"{sizing.memory_request_mib}Mi"},
        "limits": {"cpu": f"{sizing.cpu_limit_m}m", "memory": f"{sizing.memory_limit_mib}Mi"},
    }
    if sizing.gpus:
        resources["limits"]["nvidia.com/gpu"] = sizing.gpus
    return resources


def _probe(path: str, period: int, failures: int, port: str = "http") -> dict:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
        "successThreshold": 1,
    }


def service(options: DeployOptions, labels: dict) -> dict:
    ports = [
        {"name": name, "port": port, "targetPort": name, "protocol": "TCP"} for name, port in serving_ports(options)
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": options.name, "labels": labels},
        "spec": {"type": "ClusterIP", "selector": labels, "ports": ports},
    }


def _cpu_metric(options: DeployOptions) -> dict:
    return {
        "type": "Resource",
        "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": options.cpu_utilization}},
    }


# The queue gauge each server exports, as a Prometheus adapter exposes it (its rule renames ':' away; docs).
QUEUE_METRICS = {
    "openai": ("vllm:num_requests_waiting", "vllm_num_requests_waiting"),
    "triton-trtllm": ("nv_inference_pending_request_count", "nv_inference_pending_request_count"),
}


def queue_metric_name(server: str, trtllm: bool) -> tuple[str, str]:
    """(the server's Prometheus series, the custom-metrics name the adapter serves it under)."""
    return QUEUE_METRICS["triton-trtllm" if server == "triton" and trtllm else server]


def _queue_metric(options: DeployOptions, trtllm: bool) -> dict:
    _, name = queue_metric_name(options.server, trtllm)
    return {
        "type": "Pods",
        "pods": {
            "metric": {"name": name},
            "target": {"type": "AverageValue", "averageValue": str(options.queue_per_replica)},
        },
    }


def autoscaler(options: DeployOptions, labels: dict, metric: dict) -> dict:
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": options.name, "labels": labels},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": options.name},
            "minReplicas": options.min_replicas,
            "maxReplicas": options.max_replicas,
            "metrics": [metric],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}},
        },
    }


def kustomization(options: DeployOptions) -> dict:
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [
            "deployment.yaml",
            "service.yaml",
            "pdb.yaml",
            "networkpolicy.yaml",
            f"hpa-{options.autoscale}.yaml",
        ],
    }


def write_manifests(
    bundle: str | os.PathLike,
    out: str | os.PathLike,
    options: DeployOptions,
    measured: Measured | None = None,
    overwrite: bool = False,
) -> dict[str, dict]:
    """``manifests`` written as YAML into ``out`` with a kustomization.yaml (``kubectl apply -k out``)."""
    out = Path(out)
    objects = manifests(bundle, options, measured)
    files = {**objects, "kustomization.yaml": kustomization(options)}
    existing = [name for name in files if (out / name).exists()]
    if existing and not overwrite:
        raise DeployError(f"{out} already holds {', '.join(existing)}; pass --overwrite to replace them")
    out.mkdir(parents=True, exist_ok=True)
    for name, document in files.items():
        (out / name).write_text(
            _header(name, options, objects) + yaml.dump(document, Dumper=_Dumper, sort_keys=False), encoding="utf-8"
        )
    return objects


class _Dumper(yaml.SafeDumper):
    """Plain YAML: no anchors and aliases for repeated objects (the labels), which not every tool reads."""

    def ignore_aliases(self, data) -> bool:
        return True


def no_key_warning(options: DeployOptions) -> str | None:
    """What a deployment anyone in its namespace can use without a key says, loudly (None: it has a key)."""
    if options.server == "triton":
        return (
            "WARNING: no API key: Triton has no authentication; any pod in this namespace can use it (the "
            "NetworkPolicy admits no one else). Put an authenticating proxy in front."
        )
    if not options.api_key_secret:
        return (
            "WARNING: no API key (--api-key-secret): any pod in this namespace can use this server (the "
            "NetworkPolicy admits no one else)."
        )
    return None


def _header(name: str, options: DeployOptions, objects: dict) -> str:
    warning = no_key_warning(options)
    if name == "deployment.yaml" and warning:
        return f"# written by draftsmith deploy kubernetes\n# {warning}\n"
    if name != "hpa-queue.yaml":
        return "# written by draftsmith deploy kubernetes\n"
    metric = objects[name]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    series = next(s for s, n in QUEUE_METRICS.values() if n == metric)
    return (
        "# Scale on the queue: needs a custom-metrics adapter (e.g. prometheus-adapter) serving the per-pod\n"
        f'# series {series} as the pods metric {metric}; see docs/operations.md, "Scaling out".\n'
    )


# --- command ------------------------------------------------------------------------------------------------------


@click.group("deploy")
def deploy():
    """Deployment manifests for a bundle."""


@deploy.command("kubernetes")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for the manifests.")
@click.option(
    "--server",
    type=click.Choice(SERVERS),
    default="openai",
    show_default=True,
    help="openai: draftsmith serve-openai; triton (tensorrt_llm bundles only): NVIDIA's tritonserver on a "
    "repository written at pod start.",
)
@click.option("--name", default="draftsmith", show_default=True, help="Name of every object (a DNS label).")
@click.option(
    "--image",
    default="draftsmith:cpu",
    show_default=True,
    help="The image with draftsmith installed (the Dockerfile's); the bundle is not in it.",
)
@click.option("--replicas", type=int, default=2, show_default=True)
@click.option("--threads", type=int, default=2, show_default=True, help="ONNX Runtime threads per pod (its CPU).")
@click.option("--max-batch", type=int, default=8, show_default=True, help="Requests decoded together per pod.")
@click.option("--max-queue", type=int, default=256, show_default=True)
@click.option("--policy", type=click.Choice(["exact", "throughput"]), default="exact", show_default=True)
@click.option(
    "--bundle-source",
    type=click.Choice(BUNDLE_SOURCES),
    default="pvc",
    show_default=True,
    help="pvc: mount --bundle-pvc read-only; image: an init container copies /bundle from --bundle-image.",
)
@click.option(
    "--bundle-pvc",
    default="draftsmith-bundle",
    show_default=True,
    help="A PersistentVolumeClaim holding the bundle at its root.",
)
@click.option("--bundle-image", default="", help="An image holding the bundle at /bundle (--bundle-source image).")
@click.option(
    "--autoscale",
    type=click.Choice(AUTOSCALERS),
    default="cpu",
    show_default=True,
    help="Which autoscaler the kustomization applies (both are written): CPU, or the queue length "
    "(needs a custom-metrics adapter).",
)
@click.option("--min-replicas", type=int, default=2, show_default=True)
@click.option("--max-replicas", type=int, default=8, show_default=True)
@click.option(
    "--drain-linger",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds a stopping pod keeps answering 503 (endpoint removal reaching every node).",
)
@click.option(
    "--api-key-secret",
    default="",
    help="A Secret with key DRAFTSMITH_API_KEY, mounted as a file the server reads (openai server).",
)
@click.option(
    "--triton-image",
    default=TRTLLM_TRITON_IMAGE,
    show_default=True,
    help="tensorrt_llm bundles served by Triton: NVIDIA's Triton TRT-LLM image of the bundle's release.",
)
@click.option(
    "--upstream-models",
    default="",
    help="tensorrt_llm + triton: upstream's inflight_batcher_llm (or llmapi) folder inside --image.",
)
@click.option("--load-seconds", type=float, default=None, help="Instead of measuring: seconds to load.")
@click.option("--memory-mib", type=float, default=None, help="Instead of measuring: peak MiB of one server.")
@click.option("--tokens-per-second", type=float, default=None, help="Instead of measuring: one request's speed.")
@click.option("--overwrite", is_flag=True, help="Replace manifests already in --out.")
def kubernetes(bundle, out, load_seconds, memory_mib, tokens_per_second, overwrite, **choices):
    """Write Kubernetes manifests serving BUNDLE into --out (apply with kubectl apply -k OUT)."""
    try:
        options = DeployOptions(**choices)
        measured = _given(bundle, options, load_seconds, memory_mib, tokens_per_second)
        objects = write_manifests(bundle, out, options, measured, overwrite=overwrite)
    except (DeployError, BundleError, subprocess.TimeoutExpired) as err:
        raise click.ClickException(str(err)) from None
    sizing = json.loads(objects["deployment.yaml"]["metadata"]["annotations"]["draftsmith/sizing"])
    click.echo(f"wrote {out}: {', '.join(objects)}, kustomization.yaml (autoscaler: hpa-{options.autoscale}.yaml)")
    click.echo(
        f"sizing ({sizing['how']}): load {sizing['load_s']} s, peak {sizing['rss_mib']} MiB, "
        f"{sizing['tokens_per_s']} tok/s -> grace {sizing['grace_s']} s, memory request "
        f"{sizing['memory_request_mib']} Mi" + (f", {sizing['gpus']} GPU(s)" if sizing["gpus"] else "")
    )
    warning = no_key_warning(options)
    if warning:
        click.secho(warning, fg="red", bold=True, err=True)
    click.echo(f"apply it:  kubectl apply -k {out}")


def _given(bundle: str, options: DeployOptions, load_s, rss_mib, tokens_per_s) -> Measured | None:
    """The figures given on the command line, the rest measured (or estimated); None when none was given."""
    given = {"load_s": load_s, "rss_mib": rss_mib, "tokens_per_s": tokens_per_s}
    if all(value is None for value in given.values()):
        return None
    bad = [f"{name}={value!r}" for name, value in given.items() if value is not None and not value > 0]
    if bad:
        raise DeployError(f"expected figures > 0, received {', '.join(bad)}")
    if all(value is not None for value in given.values()):
        return Measured(**given, how="given")
    root = Path(bundle)
    manifest = load_manifest(root, verify=False)
    base = (
        estimate_trtllm(root, manifest)
        if manifest.spec.backend == "tensorrt_llm"
        else measure(root, options.threads, options.max_batch, options.policy)
    )
    return replace(base, **{k: v for k, v in given.items() if v is not None}, how=base.how + " (some given)")
