#!/usr/bin/env bash
# GPU check of the trainer runtime (docs/trainer.md): on one CUDA device, with the machine's own
# python3 and torch (not the project venv), train with NCCL at DP=1, preempt and resume, check the
# losses, exercise the fp16 loss scaler across a preemption, and run the trainer benchmark.
# Writes everything into $OUT (or a temporary directory) and ends with a one-line verdict.
# Usage: bash bench/gpu_check.sh     (about 2-4 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$(mktemp -d -t omni-gpu-check-XXXX)}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
RUNS="$(mktemp -d -t omni-gpu-runs-XXXX)"
STATUS=0
log() { echo "[gpu_check $(date -u +%H:%M:%S)] $*" | tee -a "$OUT/gpu_check.log"; }
train() { timeout 240 "$PY" -m trainer_agent.train --device cuda --dp 1 "$@" >>"$OUT/train.log" 2>&1; }

"$PY" -c "import numpy" 2>/dev/null || "$PY" -m pip install -q numpy >>"$OUT/gpu_check.log" 2>&1
"$PY" - <<'EOF' | tee "$OUT/environment.txt"
import torch, platform
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("devices", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NONE")
print("nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)
EOF

COMMON=(--steps 30 --seed 3 --global-batch 16 --micro-batch 2 --checkpoint-every 10)
log "fp32 reference: 30 steps, dp 1, NCCL"
train --run-dir "$RUNS/ref" "${COMMON[@]}" || { log "FAIL reference run"; STATUS=1; }
log "fp32 preempt at step 12, then resume"
train --run-dir "$RUNS/pre" "${COMMON[@]}" --stop-at-step 12 || { log "FAIL preempted run"; STATUS=1; }
train --run-dir "$RUNS/pre" "${COMMON[@]}" || { log "FAIL resumed run"; STATUS=1; }
log "fp32 SIGTERM during training, then resume"
timeout 240 "$PY" -m trainer_agent.train --device cuda --dp 1 --run-dir "$RUNS/sig" "${COMMON[@]}" --steps 2000 --schedule-steps 30 >>"$OUT/train.log" 2>&1 &
PID=$!
for _ in $(seq 1 600); do kill -0 "$PID" 2>/dev/null || break; [ -f "$RUNS/sig/metrics.jsonl" ] && [ "$(wc -l <"$RUNS/sig/metrics.jsonl")" -ge 5 ] && break; sleep 0.1; done
kill -TERM "$PID"; wait "$PID" || { log "FAIL SIGTERM run exit code"; STATUS=1; }
train --run-dir "$RUNS/sig" "${COMMON[@]}" || { log "FAIL SIGTERM resume"; STATUS=1; }

FP16=(--steps 16 --seed 3 --precision fp16 --checkpoint-every 100)
log "fp16 (loss scaler) reference and preempt-at-8 + resume"
train --run-dir "$RUNS/h-ref" "${FP16[@]}" || { log "FAIL fp16 reference"; STATUS=1; }
train --run-dir "$RUNS/h-pre" "${FP16[@]}" --stop-at-step 8 || { log "FAIL fp16 preempt"; STATUS=1; }
train --run-dir "$RUNS/h-pre" "${FP16[@]}" || { log "FAIL fp16 resume"; STATUS=1; }

for run in ref pre sig h-ref h-pre; do cp "$RUNS/$run/metrics.jsonl" "$OUT/metrics-$run.jsonl" 2>/dev/null; done
"$PY" - "$RUNS" <<'EOF' | tee "$OUT/loss_check.json" || STATUS=1
import json, statistics, sys
runs = sys.argv[1]
def losses(name):
    try:
        return {r["step"]: r for r in map(json.loads, open(f"{runs}/{name}/metrics.jsonl"))}
    except OSError:
        return {}
report, ok = {}, True
for pair, steps in (("ref:pre", 30), ("ref:sig", 30), ("h-ref:h-pre", 16)):
    a, b = (losses(n) for n in pair.split(":"))
    common = sorted(set(a) & set(b))
    bitwise = sum(a[s]["loss"] == b[s]["loss"] for s in common)
    rel = max((abs(a[s]["loss"] - b[s]["loss"]) / abs(a[s]["loss"]) for s in common), default=None)
    good = len(common) == steps and rel is not None and rel <= 1e-4
    ok &= good
    report[pair] = {"steps_compared": len(common), "bitwise_equal": bitwise, "max_rel_diff": rel, "ok": good}
ref = losses("ref")
if ref:
    report["fp32_first_last_loss"] = [ref[1]["loss"], ref[max(ref)]["loss"]]
    report["fp32_step_s_median"] = statistics.median(r["step_s"] for r in list(ref.values())[3:])
    report["fp32_compute_s_median"] = statistics.median(r["compute_s"] for r in list(ref.values())[3:])
report["ok"] = ok
print(json.dumps(report))
sys.exit(0 if ok else 1)
EOF

log "bench.trainer --device cuda"
timeout 300 "$PY" -m bench.trainer --json --device cuda >"$OUT/bench_trainer.json" 2>"$OUT/bench_trainer.stderr" || { log "FAIL bench"; STATUS=1; }
rm -rf "$RUNS"
if [ "$STATUS" -eq 0 ]; then log "OK: all GPU checks passed; outputs in $OUT"; else log "FAILED: see $OUT/gpu_check.log and $OUT/train.log"; fi
exit "$STATUS"
