#!/usr/bin/env bash
# The main job on a fresh machine: set up, distil the default preset's draft (its recipe; ~20 minutes on 2 cores,
# once), build the default SmolLM2 bundle, generate with it, print acceptance and speedup over target-only decoding.
# PRESET=configs/smollm2-135m-self.yaml skips the distillation (int4 self-draft; ~5 minutes in all).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
PRESET=${PRESET:-configs/smollm2-135m.yaml}
BUNDLE=${BUNDLE:-bundles/$(basename "$PRESET" .yaml)}
if [ ! -f "$BUNDLE/manifest.json" ]; then
  if grep -q '^distill:' "$PRESET"; then
    draftsmith distill --config "$PRESET" --threads "${THREADS:-2}"
  fi
  build-engines --config "$PRESET" --out "$BUNDLE"
fi
build-engines inspect "$BUNDLE"
draftsmith generate "$BUNDLE" "${PROMPT:-Write a Python function that checks whether a number is prime.}" \
  --chat --max-new-tokens "${MAX_NEW_TOKENS:-128}" --threads "${THREADS:-2}"
