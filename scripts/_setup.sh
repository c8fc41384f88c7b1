# Sourced by scripts/train and scripts/test: create .venv and install bigbatch
# into it, once, and again only when pyproject.toml changes.
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
export PATH="$venv/bin:$PATH"
