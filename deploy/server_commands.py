"""Each server's command line as a pod runs it (``serve-openai``; tritonserver under mpirun on a TensorRT-LLM
repository written at pod start), and ``check_server``, which refuses a Triton that would put known unauthenticated
CVEs on a pod's network."""

from __future__ import annotations

from deploy.options import (
    API_KEY_DIR,
    BUNDLE_PATH,
    FIRST_FIXED_TRITON,
    GRPC_PORT,
    HEALTH_PORT,
    HTTP_PORT,
    METRICS_PORT,
    NGC_TRITON_TAG,
    TRITONSERVER,
    WORK_PATH,
    DeployError,
    DeployOptions,
)
from deploy.sizing import Sizing
from runtime.bundle import Manifest


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
