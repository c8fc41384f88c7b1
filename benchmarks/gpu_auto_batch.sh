#!/usr/bin/env bash
# One prepared run on a lent GPU for issue 36 (the growing batch) plus the checks every
# GPU session makes: the cuda tests, the main job on one GPU, the MNIST-1D auto-batch
# study (examples/study_auto_batch.toml: seconds per cell), the large-corpus charlm study
# with a d_model 512, 8-layer model (examples/study_charlm_gpu.toml), and
# benchmarks/optim_step.py on ResNet-50 shapes. Each part has its own time limit; logs
# and the studies' reports go under $OUT, a short summary is printed last. Runs from the
# repository root with the machine's own python3 (bigbatch is not installed: PYTHONPATH=.).
# That image lacks two pure-Python dependencies: copy them from .venv into .devdeps
# (git-ignored) and name it in the device call's carry:
#   mkdir -p .devdeps && cp -r .venv/lib/python3.11/site-packages/{tomli_w,mnist1d*} .devdeps/
#   PYTHONPATH=$PWD/.devdeps bash benchmarks/gpu_auto_batch.sh      (carry: [".devdeps"])
set -uo pipefail
OUT="${OUT:-/tmp/gpu_auto_batch}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=python3
runs="${RUNS:-/tmp/bigbatch-runs}"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
{ nvidia-smi -L; $py -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"; } \
    >"$OUT/env.txt" 2>&1
stamp "cuda tests" >>"$OUT/times.txt"
timeout -s INT "${TEST_S:-70}" $py -m pytest -q -p no:cacheprovider -o addopts="" --maxfail=5 \
    -m cuda tests/ >"$OUT/cuda_tests.txt" 2>&1
stamp "main job" >>"$OUT/times.txt"
timeout -s INT "${MAIN_S:-60}" $py -m bigbatch train --out "$runs/main" --overwrite >"$OUT/main_job.txt" 2>&1
stamp "charlm d512 study" >>"$OUT/times.txt"
timeout -s INT "${CHARLM_S:-190}" $py -m bigbatch study --config examples/study_charlm_gpu.toml \
    --out "$runs/charlm-gpu" --no-progress >"$OUT/study_charlm.txt" 2>&1
stamp "mnist1d study, seed 0" >>"$OUT/times.txt"
timeout -s INT "${MNIST_S:-110}" $py -m bigbatch study --config examples/study_auto_batch.toml \
    --seeds 0 --out "$runs/mnist" --no-progress >"$OUT/study_mnist_s0.txt" 2>&1
stamp "mnist1d study, seeds 0,1" >>"$OUT/times.txt"
timeout -s INT "${MNIST_S:-110}" $py -m bigbatch study --config examples/study_auto_batch.toml \
    --out "$runs/mnist" --no-progress >"$OUT/study_mnist.txt" 2>&1
stamp "optim_step resnet50" >>"$OUT/times.txt"
timeout "${RESNET_S:-30}" $py benchmarks/optim_step.py --device cuda --model resnet50 \
    --rounds 20 >"$OUT/optim_resnet50.txt" 2>&1
stamp "done" >>"$OUT/times.txt"
tar czf "$OUT/studies.tar.gz" -C "$runs" --exclude='*.pt' --exclude='checkpoints' \
    --exclude='*.distcp' . 2>/dev/null
cat "$OUT/env.txt" "$OUT/times.txt"
echo "== cuda tests: $(tail -n 1 "$OUT/cuda_tests.txt")"
grep -E "^(FAILED|ERROR)" "$OUT/cuda_tests.txt" | head -n 8
echo "== main job"; tail -n 4 "$OUT/main_job.txt"
for f in study_charlm study_mnist_s0 study_mnist; do
    echo "== $f"; tail -n 6 "$OUT/$f.txt"
done
echo "== optim_step"; grep -E "ratios|x torch" "$OUT/optim_resnet50.txt" | head -n 8
