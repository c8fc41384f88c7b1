#!/usr/bin/env bash
# One prepared run of benchmarks/lr_find_variants.py on a lent GPU (each MNIST-1D cell
# takes seconds there, against ten minutes on this CPU). Run from the repository root
# with the machine's own python3; the wheels torch's image lacks (tomli_w, mnist1d) are
# carried in .whl/. Prints one line per variant; $OUT/variants.txt keeps them.
#
#   VARIANTS="lars-find demo-find" SEEDS="0 1 2 3" bash benchmarks/gpu_lr_find.sh
set -uo pipefail
OUT="${OUT:-/tmp/lr_find_variants}"
mkdir -p "$OUT"
pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD"
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__)"
# shellcheck disable=SC2086
timeout "${VARIANTS_S:-300}" python3 benchmarks/lr_find_variants.py --out "$OUT/v" \
    --seeds ${SEEDS:-0 1 2 3} ${VARIANTS:+--only $VARIANTS} 2>&1 | grep -E "^[a-z0-9.-]+ +[0-9.]+%"
cp "$OUT/v/variants.txt" "$OUT/variants.txt"
rm -rf "$OUT/v"   # the cells' folders: too many files to bring back
