#!/usr/bin/env bash
# The async overlap check on a host with free cores. The device machine has 16 CPU cores and one GPU; async
# needs two device sets, so this runs the CPU benchmark there (JAX_PLATFORMS=cpu, 8 virtual devices) where
# cores, not the 2 of a dev box, bound the overlap. Writes $OUT/bench_async.json (the bench's JSON line) and
# $OUT/bench_async.log; extra arguments go to tools/bench_async.py.
#   run: bash tools/device_check_async.sh                         (on the device machine, timeout_s 600)
#   here: OUT=/tmp/out bash tools/device_check_async.sh --steps 2 --runs 1 --warmup-steps 0   (a smoke run)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:?set OUT to the folder the JSON goes to}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python=${PYTHON:-python}
"$python" -c "import os, jax; print('cores', os.cpu_count(), 'jax', jax.__version__)" | tee "$out/bench_async.log"
JAX_PLATFORMS=cpu PYTHONPATH=. timeout 540 "$python" tools/bench_async.py --sim-steps 0 --out "$work/runs" "$@" \
    2>>"$out/bench_async.log" | tee -a "$out/bench_async.log" | tail -n 1 > "$out/bench_async.json"
"$python" -c "import json, sys; d = json.load(open(sys.argv[1])); print({k: d[k] for k in ('sync_s', 'async_s', \
'speedup', 'core_bound_speedup', 'cpu_count')})" "$out/bench_async.json"
