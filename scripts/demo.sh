#!/usr/bin/env bash
# The main job on a fresh machine: set up, build the default SmolLM2 bundle, generate with it, print acceptance
# and speedup over target-only decoding.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
BUNDLE=${BUNDLE:-bundles/smollm2-135m}
if [ ! -f "$BUNDLE/manifest.json" ]; then
  build-engines --config configs/smollm2-135m.yaml --out "$BUNDLE"
fi
build-engines inspect "$BUNDLE"
draftsmith generate "$BUNDLE" "${PROMPT:-Write a Python function that checks whether a number is prime.}" \
  --chat --max-new-tokens "${MAX_NEW_TOKENS:-128}" --threads "${THREADS:-2}"
