"""Where TensorRT-LLM's examples, Triton models and launch script live in the two NVIDIA container images.

* TensorRT-LLM's release image (NVIDIA/TensorRT-LLM ``docker/Dockerfile.multi``, stage ``release``: ``WORKDIR
  /app/tensorrt_llm`` + ``COPY examples examples``; stage ``tritonrelease`` adds ``triton_backend/all_models``,
  ``triton_backend/scripts`` there).
* NGC's ``tritonserver:<yy.mm>-trtllm-python-py3`` (triton-inference-server/tensorrtllm_backend
  ``dockerfile/Dockerfile.triton.trt_llm_backend``: ``WORKDIR /app``, ``COPY ... scripts``, ``all_models``,
  ``tools``, ``examples``).

tests/fixtures/trtllm/container_layouts.json records both with their commits. An environment variable always wins.
"""

from __future__ import annotations

import os
from pathlib import Path

LAYOUTS = {
    "tensorrt_llm release": {
        "examples": "/app/tensorrt_llm/examples",
        "triton_models": "/app/tensorrt_llm/triton_backend/all_models",
        "launch_script": "/app/tensorrt_llm/triton_backend/scripts/launch_triton_server.py",
    },
    "tritonserver trtllm-python-py3": {
        "examples": "/app/examples",
        "triton_models": "/app/all_models",
        "launch_script": "/app/scripts/launch_triton_server.py",
    },
}
ENV = {"examples": "TRTLLM_EXAMPLES", "triton_models": "TRTLLM_TRITON_MODELS", "launch_script": "TRTLLM_LAUNCH_SCRIPT"}


def candidates(kind: str) -> list[str]:
    """Where to look for ``kind`` (examples | triton_models | launch_script), the environment's choice first."""
    given = os.environ.get(ENV[kind])
    return ([given] if given else []) + [layout[kind] for layout in LAYOUTS.values()]


def find(kind: str, root: str | Path = "/") -> str | None:
    """The first candidate that exists (under ``root``, for tests), or None."""
    for path in candidates(kind):
        if (Path(root) / path.lstrip("/")).exists() if root != "/" else Path(path).exists():
            return path
    return None


def examples_dir(root: str | Path = "/") -> str:
    """The examples folder to plan with: the one found, else the release image's (named in the preflight error)."""
    return find("examples", root) or candidates("examples")[0]
