#!/usr/bin/env bash
# One prepared run on a lent GPU: tests/test_optim_cuda.py (the Triton kernel
# compiled) and tests/test_engine_cuda.py (the engine's step with no host sync), benchmarks/optim_step.py on ResNet-50 and BERT-large shapes
# (with two other Triton chunk/block/warp settings), and benchmarks/engine_gpu.py.
# Each part has its own time limit; logs go under $OUT (default /tmp/gpu_optim) and a
# compact table is printed last. Runs from the repository root with the machine's own
# python3 (bigbatch is not installed there: PYTHONPATH=.).
set -uo pipefail
OUT="${OUT:-/tmp/gpu_optim}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=python3
{ nvidia-smi -L; $py -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
    >"$OUT/env.txt" 2>&1
timeout -s INT "${TEST_S:-90}" $py -m pytest -q -p no:cacheprovider -o addopts="" --maxfail=5 \
    tests/test_optim_cuda.py tests/test_engine_cuda.py >"$OUT/cuda_tests.txt" 2>&1
sweep=(${SWEEP:-})
timeout "${RESNET_S:-35}" $py benchmarks/optim_step.py --device cuda --model resnet50 \
    --rounds 30 ${sweep[@]+"${sweep[@]}"} >"$OUT/optim_resnet50.txt" 2>&1
timeout "${BERT_S:-55}" $py benchmarks/optim_step.py --device cuda --model bert-large \
    --rounds 15 ${sweep[@]+"${sweep[@]}"} >"$OUT/optim_bert_large.txt" 2>&1
timeout "${ENGINE_S:-45}" $py benchmarks/engine_gpu.py --steps 5 --rounds 3 \
    >"$OUT/engine_gpu.txt" 2>&1
timeout "${ENGINE_S:-45}" $py benchmarks/engine_gpu.py --steps 5 --rounds 3 --amp float16 \
    >"$OUT/engine_gpu_fp16.txt" 2>&1
cat "$OUT/env.txt"
echo "== cuda tests: $(tail -n 1 "$OUT/cuda_tests.txt")"
grep -E "^(FAILED|ERROR)|Error:" "$OUT/cuda_tests.txt" | head -n 12
for f in optim_resnet50 optim_bert_large engine_gpu engine_gpu_fp16; do
    echo "== $f"
    grep -vE "^\s*$|Warning|warn" "$OUT/$f.txt" | tail -n 40
done
