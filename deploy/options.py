"""The deployment's choices (``DeployOptions``, checked when made), the constants every manifest shares (paths,
ports, the Triton image and the first release without the August 2025 CVEs) and ``DeployError``: the part of
``draftsmith deploy`` that sizing, the server commands and the manifests all read."""

from __future__ import annotations

import re
from dataclasses import dataclass

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
