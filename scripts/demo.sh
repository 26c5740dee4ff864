#!/usr/bin/env bash
# The main job on a fresh machine: set up, distil the default preset's draft (its recipe; ~20 minutes on 2 cores,
# once), build the default SmolLM2 bundle, generate with it, print acceptance and speedup over target-only decoding.
# PRESET=configs/smollm2-135m-self.yaml skips the distillation (int4 self-draft; ~5 minutes in all).
# In a log (not a terminal) each stage says what it does; the distillation prints how far it got and the time left at
# least once a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo "== demo [$(date -u +%H:%M:%S)] $*" >&2; }
step "1/4 setup: the virtual environment (a few minutes the first time, seconds after)"
bash scripts/setup.sh
. .venv/bin/activate
PRESET=${PRESET:-configs/smollm2-135m.yaml}
BUNDLE=${BUNDLE:-bundles/$(basename "$PRESET" .yaml)}
if [ ! -f "$BUNDLE/manifest.json" ]; then
  if grep -q '^distill:' "$PRESET"; then
    step "2/4 distil the draft ($PRESET's recipe; about 20 minutes on 2 cores, kept once done)"
    draftsmith distill --config "$PRESET" --threads "${THREADS:-2}"
  fi
  step "3/4 build the bundle $BUNDLE (a few minutes)"
  build-engines --config "$PRESET" --out "$BUNDLE"
fi
build-engines inspect "$BUNDLE"
step "4/4 generate: speculative, then target-only on the same engines"
draftsmith generate "$BUNDLE" "${PROMPT:-Write a Python function that checks whether a number is prime.}" \
  --chat --max-new-tokens "${MAX_NEW_TOKENS:-128}" --threads "${THREADS:-2}"
