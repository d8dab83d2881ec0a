#!/usr/bin/env bash
# The GPU check: install torchloom beside the machine's torch, run the `gpu` tests, and
# benchmark eager vs torch.compile vs the torchloom schedule on GPT-2 and Llama on CUDA.
#
#   bash benchmarks/gpu_check.sh            # from the repository root, on a CUDA machine
#
# Made for one GPU, no network, at most 8 minutes (checked on: nothing yet, see README).
# Every stage has a time limit taken from one deadline (DEADLINE_S, default 450 s), so
# the script ends in time and prints, last, one table of what finished (Markdown, ready
# for the README: date, GPU, versions, command).
#
# What it does:
#   1. `pip install --no-deps --no-build-isolation --no-index -e .`: the machine's torch,
#      transformers and the rest stay as they are (nothing is downloaded); if that fails
#      (an old setuptools), src/ goes on PYTHONPATH instead.
#   2. `pytest -m gpu tests/test_gpu.py` (CUDA vs CPU within the documented bf16/TF32
#      tolerances, RNG and fork_rng, build from meta to CUDA, compile, train --device cuda).
#   3. `torchloom bench --device cuda --size gpu` for each model (about 300M parameters,
#      1024 tokens, bf16 autocast; the activation budget and max batch fill the device;
#      the checkpoint ratios 0 / 0.5 / 1 are fitted and the candidates timed).
#   3b. benchmarks/plan_vs_gpu.py: a 1B-class Llama trained a few steps at two layouts,
#      the planner's peak reserved memory and tokens/s against the measured ones.
#
# Knobs (environment): MODELS (gpt2,llama), SIZE (gpu), BUDGET_GB (40), MAX_BATCH (64),
# STEPS (3), SWEEP_STEPS (1), DEADLINE_S (450), TEST_LIMIT_S (170), OUT (/tmp/torchloom-gpu-check).
# DRY_RUN=1: the plumbing on a CPU (tiny size, CPU test variants, no install), for checking
# this script where there is no GPU.
set -uo pipefail

cd "$(dirname "$0")/.."
START=$(date +%s)
DRY_RUN=${DRY_RUN:-0}
OUT=${OUT:-${TMPDIR:-/tmp}/torchloom-gpu-check}
MODELS=${MODELS:-gpt2,llama}
if [ "$DRY_RUN" = 1 ]; then
    DEVICE=cpu SIZE=${SIZE:-tiny} BUDGET_GB=${BUDGET_GB:-0.002} MAX_BATCH=${MAX_BATCH:-8}
    STEPS=${STEPS:-2} SWEEP_STEPS=${SWEEP_STEPS:-1} DEADLINE_S=${DEADLINE_S:-900}
    TEST_LIMIT_S=${TEST_LIMIT_S:-300} BACKEND=${BACKEND:-aot_eager}
    TEST_SELECT=(-k "rng or fork_rng or well_formed or weights_straight")
    export TORCHLOOM_TEST_DEVICE=cpu
else
    DEVICE=cuda SIZE=${SIZE:-gpu} BUDGET_GB=${BUDGET_GB:-40} MAX_BATCH=${MAX_BATCH:-64}
    STEPS=${STEPS:-3} SWEEP_STEPS=${SWEEP_STEPS:-1} DEADLINE_S=${DEADLINE_S:-450}
    TEST_LIMIT_S=${TEST_LIMIT_S:-170} BACKEND=${BACKEND:-inductor}
    TEST_SELECT=()
fi
PY=${PYTHON:-python}
mkdir -p "$OUT"
rm -f "$OUT"/bench-*.json "$OUT"/status-*.txt

left() { echo $(( DEADLINE_S - ($(date +%s) - START) )); }
stage() { echo; echo "=== $* (t=$(( $(date +%s) - START )) s)"; }

# ------------------------------------------------------------------ 0. the machine
stage "machine"
if ! $PY - <<'EOF'
import sys, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, bf16: {torch.cuda.is_bf16_supported()}")
missing = []
for name in ("transformers", "numpy", "rich", "typer", "safetensors", "pytest"):
    try:
        __import__(name)
    except ImportError:
        missing.append(name)
if missing:
    print("missing packages (install them; this script downloads nothing):", ", ".join(missing))
    sys.exit(1)
import transformers
print(f"transformers {transformers.__version__}")
EOF
then
    echo "the environment lacks what torchloom needs; stopping"; exit 2
fi
if [ "$DEVICE" = cuda ] && ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "torch sees no CUDA device; run with DRY_RUN=1 to check the script on a CPU"; exit 2
fi

# ------------------------------------------------------------------ 1. install
stage "install (pip install --no-deps -e ., the machine's torch stays)"
TORCH_BEFORE=$($PY -c "import torch; print(torch.__version__)")
if [ "$DRY_RUN" = 1 ]; then
    echo "dry run: not installing (torchloom imports from $($PY -c 'import torchloom, os; print(os.path.dirname(torchloom.__file__))'))"
elif $PY -m pip install --no-deps --no-build-isolation --no-index --quiet -e . ; then
    echo "installed: $($PY -m pip show torchloom 2>/dev/null | grep -E '^(Name|Version|Editable)' | tr '\n' ' ')"
else
    echo "pip install -e . failed (see above); using PYTHONPATH=$PWD/src"
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
TORCH_AFTER=$($PY -c "import torch; print(torch.__version__)")
[ "$TORCH_BEFORE" = "$TORCH_AFTER" ] || echo "WARNING: torch changed from $TORCH_BEFORE to $TORCH_AFTER"
$PY -c "import torchloom; print('torchloom', torchloom.__version__, 'from', torchloom.__file__)" || exit 2
if command -v torchloom >/dev/null 2>&1 && [ -z "${PYTHONPATH:-}" ]; then TL=(torchloom); else TL=($PY -m torchloom); fi

# ------------------------------------------------------------------ 2. gpu tests
LIMIT=$(( $(left) - 150 )); [ "$LIMIT" -gt "$TEST_LIMIT_S" ] && LIMIT=$TEST_LIMIT_S
stage "gpu tests (limit ${LIMIT} s)"
if [ "$LIMIT" -gt 20 ]; then
    timeout --kill-after=10 "$LIMIT" $PY -m pytest -m gpu -q -rs -p no:cacheprovider \
        --durations=5 "${TEST_SELECT[@]}" tests/test_gpu.py 2>&1 | tee "$OUT/tests.log"
    TEST_RC=${PIPESTATUS[0]}
else
    echo "no time left for the tests"; TEST_RC=124
fi
TEST_LINE=$(grep -E "passed|failed|error|skipped" "$OUT/tests.log" 2>/dev/null | tail -1)
[ "$TEST_RC" = 124 ] || [ "$TEST_RC" = 137 ] && TEST_LINE="timed out after ${LIMIT} s: ${TEST_LINE}"

# ------------------------------------------------------------------ 3. bench
IFS=, read -r -a NAMES <<< "$MODELS"
BUDGET_MB=$($PY -c "print(round(float('$BUDGET_GB') * 1024, 3))")
i=0
for name in "${NAMES[@]}"; do
    remaining=$(( ${#NAMES[@]} - i )); i=$(( i + 1 ))
    LIMIT=$(( ($(left) - 15) / remaining ))
    stage "torchloom bench $name on $DEVICE (limit ${LIMIT} s)"
    if [ "$LIMIT" -lt 20 ]; then echo "no time left"; echo "no time left" > "$OUT/status-$name.txt"; continue; fi
    CMD=("${TL[@]}" bench --models "$name" --size "$SIZE" --device "$DEVICE"
         --budget-mb "$BUDGET_MB" --max-batch "$MAX_BATCH" --steps "$STEPS"
         --sweep-steps "$SWEEP_STEPS" --compile-backend "$BACKEND" --json "$OUT/bench-$name.json")
    echo "${CMD[*]}" > "$OUT/cmd-$name.txt"
    timeout --kill-after=10 "$LIMIT" "${CMD[@]}"
    rc=$?
    case $rc in
        0) echo ok > "$OUT/status-$name.txt" ;;
        124|137) echo "timed out after $LIMIT s" > "$OUT/status-$name.txt" ;;
        *) echo "failed (exit $rc)" > "$OUT/status-$name.txt" ;;
    esac
done

# ------------------------------------------------------------------ 3b. plan vs measured
LIMIT=$(( $(left) - 20 ))
stage "planner vs this device: a 1B-class Llama at two layouts (limit ${LIMIT} s)"
if [ "$LIMIT" -gt 30 ]; then
    DRY=(); [ "$DRY_RUN" = 1 ] && DRY=(--dry-run)
    timeout --kill-after=10 "$LIMIT" $PY benchmarks/plan_vs_gpu.py "${DRY[@]}" 2>&1 \
        | grep -v '^\[rank' | tee "$OUT/plan-vs-gpu.md"
else
    echo "no time left" | tee "$OUT/plan-vs-gpu.md"
fi

# ------------------------------------------------------------------ 4. the table (last)
stage "summary"
TEST_LINE="$TEST_LINE" TOTAL_S=$(( $(date +%s) - START )) OUT="$OUT" MODELS="$MODELS" \
BUDGET_GB="$BUDGET_GB" $PY - <<'EOF'
import datetime, json, os, platform, sys
import torch, transformers
out, models = os.environ["OUT"], os.environ["MODELS"].split(",")
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or platform.machine()})"
print(f"{datetime.date.today().isoformat()}, {gpu}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}, Python {platform.python_version()}; "
      f"activation budget {os.environ['BUDGET_GB']} GiB; whole check {os.environ['TOTAL_S']} s")
print(f"gpu tests: {os.environ.get('TEST_LINE') or 'not run'}")
rows, notes = [], []
for name in models:
    status_file = os.path.join(out, f"status-{name}.txt")
    status = open(status_file).read().strip() if os.path.exists(status_file) else "not run"
    cmd_file = os.path.join(out, f"cmd-{name}.txt")
    if os.path.exists(cmd_file):
        notes.append(f"{name}: `{open(cmd_file).read().strip()}` ({status})")
    path = os.path.join(out, f"bench-{name}.json")
    if not os.path.exists(path):
        continue
    for r in json.load(open(path)):
        rows.append(r)
        if r["variant"] == "torchloom":
            batches = " / ".join(f"{k}: {v}" for k, v in r.get("ckpt_batches", {}).items())
            sweep = ", ".join(f"{s.get('compile_scope', 'layers')} compiled, ratio {s['ckpt_ratio']:g} at batch {s['batch_size']}: "
                              f"{s['tokens_per_s']:,.0f} tok/s" for s in r.get("ckpt_sweep", []))
            notes.append(f"{name}: batch by checkpoint ratio {batches}" + (f"; timed: {sweep}" if sweep else ""))
print()
print("| model | params | variant | batch | ckpt ratio | tokens/s | vs eager | peak activations | CUDA max allocated | MFU | first step (compiles) |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    mem = r.get("cuda_max_memory_allocated")
    mem_text = f"{mem / 2**30:,.1f} GiB" if mem else "-"
    compile_text = f"{r['compile_s']:.1f} s" if "compile_s" in r else "-"
    over = "" if r["fits_budget"] else " (over)"
    print(f"| {r['model']} | {r['parameters'] / 1e6:,.0f}M | {r['variant']} | {r['batch_size']} "
          f"| {r['ckpt_ratio']:g} | {r['tokens_per_s']:,.0f} | {r['speedup_vs_eager']:.2f}x "
          f"| {r['peak_activation_bytes'] / 2**30:,.2f} GiB{over} | {mem_text} | {r['mfu']:.0%} "
          f"| {compile_text} |")
if not rows:
    print("| (no benchmark finished) | | | | | | | | | | |")
print()
for n in notes:
    print(f"* {n}")
plan = os.path.join(out, "plan-vs-gpu.md")
if os.path.exists(plan):
    print()
    print("planner vs measured (benchmarks/plan_vs_gpu.py):")
    print(open(plan).read().strip())
if rows:
    print(f"* MFU: FlopCounterMode FLOPs of the unscheduled model / (median step x "
          f"{rows[0]['peak_flops_per_s'] / 1e12:,.3g} TFLOP/s, the best matmul rate measured in "
          f"the run, bf16 on CUDA, fp32 on CPU); sequence {rows[0]['seq_len']}, {rows[0]['dtype']}")
EOF
