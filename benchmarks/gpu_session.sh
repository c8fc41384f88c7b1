#!/usr/bin/env bash
# The checks a lent GPU session runs, as one prepared call: each named part has its own
# time limit, its log under $OUT, and a short summary printed last.
#
#   bash benchmarks/gpu_session.sh [PART ...]      (default: every part, in this order)
#
# Parts:
#   cuda       the tests marked cuda                            (TEST_S, 150 s)
#   main       the main job, `bigbatch train`, on one GPU         (MAIN_S, 60 s)
#   optim      benchmarks/optim_step.py on ResNet-50 shapes      (OPTIM_S, 40 s)
#   muon       benchmarks/muon_step.py, GPT-2 small, and its share of a 0.5M-token step (MUON_S, 60 s)
#   plantime   benchmarks/plan_time_gpu.py: predicted against measured step time (PLAN_S, 170 s)
#   mnist      the MNIST-1D auto-batch study, seeds $MNIST_SEEDS (default 1)   (MNIST_S, 200 s)
#   charlm     the d_model 512 charlm study (examples/study_charlm_gpu.toml)   (CHARLM_S, 240 s)
#   charlmauto the same model's fixed 16 beside --auto-batch's rule growing 16 -> 128
#              (AdamW's fraction, 0.0075; issue 36 asks for it on a GPU)    (CHARLMAUTO_S, 240 s)
#
# Runs from the repository root with the machine's python3 (bigbatch is not installed:
# PYTHONPATH=.). The device image lacks tomli_w and mnist1d: copy them from .venv into
# .devdeps (git-ignored) and carry it:
#   mkdir -p .devdeps && cp -r .venv/lib/python3.11/site-packages/{tomli_w,mnist1d*} .devdeps/
#   PYTHONPATH=$PWD/.devdeps bash benchmarks/gpu_session.sh cuda main muon   (carry: [".devdeps"])
# Studies go under $RUNS (default /tmp/bigbatch-runs) and come back as $OUT/studies.tar.gz.
set -uo pipefail
OUT="${OUT:-/tmp/gpu_session}"
RUNS="${RUNS:-/tmp/bigbatch-runs}"
mkdir -p "$OUT" "$RUNS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=python3
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" >>"$OUT/times.txt"; }
{ nvidia-smi -L; $py -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', \
torch.__version__, 'triton', triton.__version__)"; } >"$OUT/env.txt" 2>&1

part() {  # part NAME LIMIT_S COMMAND...: run with a time limit, log to $OUT/NAME.txt
    local name=$1 limit=$2
    shift 2
    stamp "$name"
    timeout -s INT "$limit" "$@" >"$OUT/$name.txt" 2>&1
    echo "exit $?" >>"$OUT/$name.txt"
}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(cuda main optim muon plantime mnist charlm)
for p in "${parts[@]}"; do
    case $p in
    cuda) part cuda "${TEST_S:-150}" $py -m pytest -q -p no:cacheprovider -o addopts="" \
              --maxfail=10 -m cuda tests/ ;;
    main) part main "${MAIN_S:-60}" $py -m bigbatch train --out "$RUNS/main" --overwrite ;;
    optim) part optim "${OPTIM_S:-40}" $py benchmarks/optim_step.py --device cuda \
               --model resnet50 --rounds 20 ;;
    muon) part muon "${MUON_S:-60}" $py benchmarks/muon_step.py --model small --device cuda \
              --rounds 20 --train-tokens 524288 --micro 16 ;;
    plantime) part plantime "${PLAN_S:-170}" $py benchmarks/plan_time_gpu.py --device cuda \
                  --out "$OUT/time_gpu.json" ;;
    mnist) part mnist "${MNIST_S:-200}" $py -m bigbatch study \
               --config examples/study_auto_batch.toml --seeds "${MNIST_SEEDS:-1}" \
               --out "$RUNS/mnist" --no-progress ;;
    charlm) part charlm "${CHARLM_S:-240}" $py -m bigbatch study \
                --config examples/study_charlm_gpu.toml --out "$RUNS/charlm-gpu" --no-progress ;;
    charlmauto) part charlmauto "${CHARLMAUTO_S:-240}" $py -m bigbatch study \
                    --config examples/study_charlm_gpu.toml --strategies sgd,sgd@adaptive \
                    --batches 16,128 --out "$RUNS/charlm-gpu-auto" --no-progress ;;
    *) echo "unknown part $p" >>"$OUT/times.txt" ;;
    esac
done
stamp "done"
tar czf "$OUT/studies.tar.gz" -C "$RUNS" --exclude='*.pt' --exclude='checkpoints' \
    --exclude='*.distcp' . 2>/dev/null
cat "$OUT/env.txt" "$OUT/times.txt"
for p in "${parts[@]}"; do
    [ -f "$OUT/$p.txt" ] || continue
    echo "== $p"
    case $p in
    cuda) grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/cuda.txt" | tail -n 12 ;;
    *) tail -n 8 "$OUT/$p.txt" ;;
    esac
done
