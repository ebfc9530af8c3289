#!/usr/bin/env bash
# One-command GPU check: decode tokens/s against the HBM roofline, prefill tokens/s, the train step's
# MFU and device <-> pinned_host bandwidth through the transition executor, each against a ceiling measured in
# the same run (tools/gpu_check.py says what and how). Writes $OUT/gpu_check.json (OUT unset: runs/gpu_check)
# and $OUT/gpu_check.log, and prints the JSON object as the last line. Runs from the checkout, no install
# (PYTHONPATH = the repo root); PYTHON picks the interpreter (default python3). Extra arguments go to the tool.
#   device machine:  bash tools/gpu_check.sh                      (run(..., timeout_s=600); ~8 minutes on an H200)
#   here:            OUT=/tmp/gpu_check bash tools/gpu_check.sh --smoke     (tiny shapes on CPU, < 1 minute)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
out=${OUT:-runs/gpu_check}
mkdir -p "$out"
python=${PYTHON:-python3}
# The outer limit stays under a 600 s device command; the tool rewrites its JSON after every section, so a
# run cut here keeps what it measured ("complete": false).
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" OUT="$out" timeout "${GPU_CHECK_TIMEOUT:-570}" \
    "$python" tools/gpu_check.py "$@" 2> >(tee "$out/gpu_check.log" >&2)
