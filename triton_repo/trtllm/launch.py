"""Where the draft and the target run, and how TensorRT-LLM's own launcher starts the server for them.

Upstream sources (tests/fixtures/trtllm/launch_triton_server.json records the commits and the checks):

* ``triton_backend/scripts/launch_triton_server.py`` (NVIDIA/TensorRT-LLM): ``--world_size``, ``--model_repo``,
  ``--multi-model`` (sets TRTLLM_ORCHESTRATOR=1: orchestrator mode, one tritonserver that spawns the engines' worker
  ranks; it asserts ``world_size == 1`` unless ``--disable-spawn-processes``), ``--disable-spawn-processes`` (all MPI
  ranks started up front, which is what lets a model span nodes), ``--trtllm_llmapi_launch`` (each rank runs under
  ``trtllm-llmapi-launch``), ``--grpc_port/--http_port/--metrics_port``.
* tensorrtllm_backend ``docs/llama_multi_instance.md`` ("Orchestrator Mode") and TensorRT-LLM
  ``examples/draft_target_model/README.md`` (Triton workflow): ``gpu_device_ids`` per tensorrt_llm model ("0",
  "1,2,3,4" for TP), ``participant_ids`` when processes are not spawned, "rank 0 is reserved for the orchestrator
  rank", ``--world_size`` = 1 + the draft's ranks + the target's ranks.
* ``triton_backend/inflight_batcher_llm/src/model_state.cc``: ``gpu_device_ids`` and ``participant_ids`` are comma
  lists, ``;`` between model instances; ``model_instance_state.cc``: "Spawning of processes was disabled in
  orchestrator mode, but participant IDs is missing." and ``num_nodes`` (default 1).
* ``examples/llm-api/llm_mgmn_*.sh``: the LLM API across nodes runs under ``trtllm-llmapi-launch`` with as many MPI
  processes as the model's world size; on one node the LLM starts its own workers.
* ``tensorrt_llm_bls/1/lib/decode.py`` ``Request.validate``: with ``num_draft_tokens`` set it calls
  ``self.stream.any()``, so a speculative request must carry ``stream`` (upstream's own example sends false).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from runtime.trtllm.paths import LAYOUTS
from triton_repo.pbtxt import ConfigError

LAUNCH_SCRIPTS = tuple(layout["launch_script"] for layout in LAYOUTS.values())
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}  # the BLS reads model configs over gRPC at localhost:8001


@dataclass(frozen=True)
class Placement:
    """GPU ids of the target's and the draft's ranks (tp x pp each), and the nodes the ranks span."""

    target_devices: tuple[int, ...]
    draft_devices: tuple[int, ...]
    num_nodes: int = 1

    def __post_init__(self) -> None:
        problems = []
        for role in ("target", "draft"):
            ids = getattr(self, f"{role}_devices")
            if (
                not ids
                or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in ids)
                or len(set(ids)) != len(ids)
            ):
                problems.append(f"{role}_devices: expected distinct GPU ids >= 0, received {list(ids)}")
        if len(self.target_devices) != len(self.draft_devices):
            problems.append(
                f"draft_devices: expected {len(self.target_devices)} ids (draft and target engines are "
                f"built with the same tp x pp), received {len(self.draft_devices)}"
            )
        if not isinstance(self.num_nodes, int) or self.num_nodes < 1:
            problems.append(f"num_nodes: expected an integer >= 1, received {self.num_nodes!r}")
        if problems:
            raise ConfigError("; ".join(problems))

    @property
    def world(self) -> int:
        """Ranks per engine (tp x pp)."""
        return len(self.target_devices)

    @property
    def multi_node(self) -> bool:
        return self.num_nodes > 1

    def participant_ids(self) -> dict[str, tuple[int, ...]]:
        """MPI ranks per model with processes started up front: 0 orchestrator, then the draft's, then the target's."""
        return {"draft": tuple(range(1, 1 + self.world)), "target": tuple(range(1 + self.world, 1 + 2 * self.world))}

    def gpu_device_ids(self, role: str) -> str:
        return ",".join(str(d) for d in getattr(self, f"{role}_devices"))


def placement(world: int, target_devices=None, draft_devices=None, num_nodes: int = 1) -> Placement:
    """The placement for engines of ``world`` ranks; by default both on GPUs 0 .. world-1 (the draft-target guide:
    sharing the GPUs "appears better performance than placing on two separate GPUs")."""
    default = tuple(range(world))
    placed = Placement(tuple(target_devices or default), tuple(draft_devices or default), num_nodes)
    if placed.world != world:
        raise ConfigError(
            f"target_devices: expected {world} GPU ids (tp_size x pp_size of the engines), received "
            f"{list(placed.target_devices)}"
        )
    return placed


def engine_launch_args(repo: str, placed: Placement) -> list[str]:
    """launch_triton_server.py arguments for the engine-era repository (after ``python3 <script>``)."""
    args = [f"--model_repo={repo}", "--multi-model"]
    if placed.multi_node:
        args += ["--disable-spawn-processes", f"--world_size={1 + 2 * placed.world}"]
    else:
        args += ["--world_size=1"]
    return args + _ports()


def llmapi_launch_args(repo: str, world: int, num_nodes: int = 1) -> list[str]:
    """launch_triton_server.py arguments for the LLM-API repository: one rank on one node (the LLM starts its own
    workers), every rank under trtllm-llmapi-launch across nodes."""
    args = [f"--model_repo={repo}"]
    if num_nodes > 1:
        args += [f"--world_size={world}", "--trtllm_llmapi_launch"]
    return args + _ports()


def _ports() -> list[str]:
    return [f"--{name}_port={port}" for name, port in PORTS.items()]


def launch_script(args: list[str], cuda_visible: str = "") -> str:
    """launch.sh for a repository: finds launch_triton_server.py in either NVIDIA image and runs it with ``args``
    (``$REPO`` in them is the repository's own folder)."""
    found = " ".join(shlex.quote(path) for path in LAUNCH_SCRIPTS)
    quoted = " ".join(a.replace("$REPO", '"$REPO"') if "$REPO" in a else shlex.quote(a) for a in args)
    visible = f"export CUDA_VISIBLE_DEVICES={shlex.quote(cuda_visible)}\n" if cuda_visible else ""
    return (
        "#!/usr/bin/env bash\n"
        "# Start this repository with TensorRT-LLM's own launcher (triton_backend/scripts/launch_triton_server.py)."
        "\n# Written by Draftsmith; the arguments are in the repository README. Never run by Draftsmith's tests.\n"
        "set -euo pipefail\n"
        'REPO=$(cd "$(dirname "$0")" && pwd)\n'
        "LAUNCH=${TRTLLM_LAUNCH_SCRIPT:-}\n"
        f"for candidate in {found}; do\n"
        '  if [ -z "$LAUNCH" ] && [ -f "$candidate" ]; then LAUNCH=$candidate; fi\n'
        "done\n"
        'if [ -z "$LAUNCH" ]; then echo "launch_triton_server.py not found; set TRTLLM_LAUNCH_SCRIPT" >&2; '
        "exit 2; fi\n"
        f"{visible}"
        f'exec python3 "$LAUNCH" {quoted} "$@"\n'
    )


def bls_request(prompt: str, max_tokens: int, num_draft_tokens: int = 0) -> dict:
    """A tensorrt_llm_bls generate body; ``stream`` always present (decode.py reads it when drafting)."""
    body = {"text_input": prompt, "max_tokens": int(max_tokens), "stream": False}
    if num_draft_tokens:
        body["num_draft_tokens"] = int(num_draft_tokens)
    return body


def llmapi_request(prompt: str, max_tokens: int) -> dict:
    """An all_models/llmapi generate body (inputs text_input, sampling_param_max_tokens, streaming)."""
    return {"text_input": prompt, "sampling_param_max_tokens": int(max_tokens), "streaming": False}
