# Sourced by scripts/train and scripts/test: create .venv and install bigbatch
# into it, once, and again only when pyproject.toml changes; Triton too for the tests.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.bigbatch-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ]; then
    echo "bigbatch: creating $venv" >&2
    python3 -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "bigbatch: installing into $venv (first run takes about a minute)" >&2
    log="$venv/install.log"
    # torch first, pinned, so nothing resolves a newer (CUDA) build.
    if ! { "$venv/bin/python" -m pip install "torch==2.13.0" &&
           "$venv/bin/python" -m pip install -e "$root[dev]"; } >"$log" 2>&1; then
        tail -n 30 "$log" >&2
        echo "bigbatch: installation failed; full log in $log" >&2
        exit 1
    fi
    echo "$want" > "$stamp"
fi
# scripts/test (BIGBATCH_WITH_TRITON=1) adds Triton, once, so that the tests run the
# optimizers' Triton kernels through its interpreter on CPU; scripts/train does not
# (Triton is ~1 GB, and a CPU job never needs it).
triton="triton==3.6.0"
if [ "${BIGBATCH_WITH_TRITON:-0}" = 1 ] && [ "$(cat "$venv/.triton-installed" 2>/dev/null)" != "$triton" ]; then
    echo "bigbatch: installing $triton into $venv for the tests (once)" >&2
    if ! "$venv/bin/python" -m pip install "$triton" >"$venv/install-triton.log" 2>&1; then
        tail -n 30 "$venv/install-triton.log" >&2
        echo "bigbatch: installing $triton failed; its tests will be skipped (log: $venv/install-triton.log)" >&2
    else
        echo "$triton" > "$venv/.triton-installed"
    fi
fi
export PATH="$venv/bin:$PATH"
