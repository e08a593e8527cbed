#!/usr/bin/env bash
# The GPU check: what this project cannot measure on its CPU machines, in one run of at most
# 10 minutes (DEADLINE_S) on one CUDA GPU. Each step has a deadline of its own within the total,
# writes bench/results/gpu_*.json and is reported at the end; a failed or timed-out step does not
# stop the others (the script then exits 1).
#
#   bench/gpu_check.sh                            # on a machine with a CUDA GPU, from the repository root
#   PYTHON=/path/to/python bench/gpu_check.sh     # the interpreter with torch (CUDA) and p2p-diloco installed
#   bench/gpu_check.sh --smoke /tmp/gpu-smoke     # every step on the CPU at toy sizes, results there
#
# Steps (docs/benchmarks.md, "GPU check"):
#   1. presets    small and 150m on CUDA with bf16 for 20 steps: tokens/s, MFU, peak memory
#   2. public     peers/public-150m.toml's shape (150m, Llama 2's 32,000 ids, 1,024 tokens) at
#                 micro-batches 8 and 16: does it fit a 24 GB GPU, and how fast is it
#   3. swarm      two peers sharing the GPU for 3 short rounds: equal digests after every round
#   4. inner      bench/inner_speed.py --device cuda (skipped with a message if it is absent)
#   5. diloco     k = 4 DiLoCo against data-parallel and a single worker, 40M parameters
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEADLINE_S=${DEADLINE_S:-600}
RESERVE_S=20 # kept back from every step's deadline: the summary, and a step that needs SIGKILL
START=$SECONDS
SMOKE=0
OUT=bench/results
DEVICE=cuda
if [ "${1:-}" = "--smoke" ]; then
    SMOKE=1
    OUT=${2:-/tmp/gpu-check-smoke}
    DEVICE=cpu
fi
mkdir -p "$OUT"
declare -a REPORT=()
FAILED=0

# step NAME CAP_S COMMAND...: run COMMAND under min(CAP_S, time left - RESERVE_S) seconds.
step() {
    local name=$1 cap=$2
    shift 2
    local left=$((DEADLINE_S - (SECONDS - START) - RESERVE_S))
    local budget=$((cap < left ? cap : left))
    if [ "$budget" -lt 10 ]; then
        REPORT+=("$name: skipped, the ${DEADLINE_S} s deadline is spent")
        FAILED=1
        return
    fi
    echo "== $name (at most ${budget} s)"
    local began=$SECONDS rc=0
    timeout --kill-after=10 "$budget" "$@" || rc=$?
    local took=$((SECONDS - began))
    if [ "$rc" -eq 0 ]; then
        REPORT+=("$name: ok in ${took} s")
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        REPORT+=("$name: TIMED OUT after ${took} s")
        FAILED=1
    else
        REPORT+=("$name: FAILED (exit $rc) after ${took} s")
        FAILED=1
    fi
}

preflight() {
    if [ "$SMOKE" -eq 1 ]; then
        echo "smoke run: every step on the CPU at toy sizes, results in $OUT"
        return
    fi
    if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        echo "no CUDA GPU visible to torch ($("$PY" -c 'import torch; print(torch.__version__)')): nothing to check" >&2
        exit 2
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
}

run_steps() {
    if [ "$SMOKE" -eq 1 ]; then
        local tiny=(--steps 2 --warmup-steps 1 --seq-len 32 --micro-batch 2)
        step presets 60 "$PY" bench/gpu_presets.py --device cpu --presets tiny "${tiny[@]}" --out "$OUT/gpu_presets.json"
        step public 60 "$PY" bench/gpu_presets.py --device cpu --presets tiny --vocab 32000 "${tiny[@]}" \
            --out "$OUT/gpu_public_150m.json"
        step swarm 120 "$PY" bench/gpu_swarm.py --device cpu --preset tiny --steps 3 --seq-len 64 \
            --out "$OUT/gpu_swarm.json"
        inner_speed 60 --device cpu --budget-s 10 --warmup-steps 1 --out "$OUT/inner_speed_smoke.json"
        step diloco 60 "$PY" bench/gpu_diloco.py --device cpu --smoke --out "$OUT/gpu_diloco.json"
        return
    fi
    step presets 90 "$PY" bench/gpu_presets.py --device cuda --presets small 150m --out "$OUT/gpu_presets.json"
    step public 90 "$PY" bench/gpu_presets.py --device cuda --presets 150m --vocab 32000 --micro-batch 8 16 \
        --steps 10 --out "$OUT/gpu_public_150m.json"
    step swarm 150 "$PY" bench/gpu_swarm.py --device cuda --out "$OUT/gpu_swarm.json"
    inner_speed 120 --device cuda --out "$OUT/inner_speed_gpu.json"
    step diloco 240 "$PY" bench/gpu_diloco.py --device cuda --out "$OUT/gpu_diloco.json"
}

# inner_speed CAP_S ARGS...: bench/inner_speed.py is written apart from this script; without it,
# say so and go on.
inner_speed() {
    local cap=$1
    shift
    if [ ! -f bench/inner_speed.py ]; then
        REPORT+=("inner: skipped, bench/inner_speed.py is not in this checkout")
        return
    fi
    step inner "$cap" "$PY" bench/inner_speed.py "$@"
}

summary() {
    echo
    echo "== GPU check: $((SECONDS - START)) s of ${DEADLINE_S} s"
    printf '%s\n' "${REPORT[@]}"
    "$PY" - "$OUT" <<'EOF' || true
import json, sys
from pathlib import Path

out = Path(sys.argv[1])

def read(name):
    path = out / name
    return json.loads(path.read_text()) if path.exists() else None

for name in ("gpu_presets.json", "gpu_public_150m.json"):
    result = read(name)
    for c in (result or {}).get("cases", []):
        mfu = f"{100 * c['mfu']:.1f} %" if c["mfu"] is not None else "n/a"
        mem = f"{c['peak_allocated_gib']:.1f} GiB" if c["peak_allocated_gib"] is not None else "n/a"
        print(f"  {c['preset']} vocab {c['vocab_size']} micro {c['micro_batch']}: "
              f"{c['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, peak {mem} ({result['device']})")
swarm = read("gpu_swarm.json")
if swarm:
    print(f"  swarm: digests agree in every round: {swarm['agree']}; both averaged: {swarm['averaged_by_both']}")
diloco = read("gpu_diloco.json")
for r in (diloco or {}).get("runs", []):
    print(f"  {r['name']}: held-out loss {r['final_eval_loss']:.4f} ({r['vs_dp_pct']:+.2f} % vs data-parallel)")
EOF
    echo "results in $OUT/"
}

preflight
run_steps
summary
exit "$FAILED"
