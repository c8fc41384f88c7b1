#!/usr/bin/env bash
# One prepared run on a lent GPU: the cuda tests, the optimizer-step benchmark
# and the main job on one GPU. Writes logs under $OUT (default /tmp/gpu_check) and
# prints a short table last. Runs from the repository root with the machine's own
# python3 (bigbatch is not installed there: PYTHONPATH=.).
set -uo pipefail
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=python3
{ nvidia-smi -L; $py -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
    2>&1 | tee "$OUT/env.txt"
timeout "${TEST_S:-150}" $py -m pytest -q -p no:cacheprovider -m cuda -o addopts="" \
    tests/test_optim_cuda.py tests/test_engine_cuda.py >"$OUT/cuda_tests.txt" 2>&1
echo "cuda tests: $(tail -n 1 "$OUT/cuda_tests.txt")"
timeout "${BENCH_S:-150}" $py benchmarks/optim_step.py --device cuda --model resnet50 \
    --rounds 30 >"$OUT/optim_resnet50.txt" 2>&1
timeout "${BENCH_S:-150}" $py benchmarks/optim_step.py --device cuda --model bert-large \
    --rounds 20 >"$OUT/optim_bert_large.txt" 2>&1
if [ -n "${TRAIN:-}" ]; then
    timeout "${TRAIN_S:-120}" $py -m bigbatch train --nproc 1 --epochs 4 --out "$OUT/train" --overwrite \
        >"$OUT/train.txt" 2>&1
    echo "main job: $(tail -n 2 "$OUT/train.txt" | tr '\n' ' ')"
fi
grep -E "FAILED|Error" "$OUT/cuda_tests.txt" | head -n 8
for f in optim_resnet50 optim_bert_large; do echo "== $f"; grep -E "ms$|x " "$OUT/$f.txt"; done
