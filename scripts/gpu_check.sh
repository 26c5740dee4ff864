#!/usr/bin/env bash
# The one GPU check: TensorRT-LLM (both flavors the installed release carries) and ONNX Runtime on CUDA when present.
# Offline (no pip, no git, no hub); run from a copy of this project inside NGC's tritonserver:<yy.mm>-trtllm-python-py3
# container on one H100/H200-class GPU:
#
#   SMOLLM2_GGUF=/data/SmolLM2-135M-Instruct.Q4_1.gguf bash scripts/gpu_check.sh
#   bash scripts/gpu_check.sh --dry-run     # every step with its time limit; runs nothing
#
# The steps, their limits and the 8-minute budget are in scripts/gpu_check.py (STEPS). Every step that cannot run
# prints "SKIP <step>: <why>". Exit status: 0 when every comparison made matched, 1 when one did not (or a step
# failed or overran its limit), 2 when nothing could run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
exec "$PY" scripts/gpu_check.py "$@"
