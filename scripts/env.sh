# Sourced by scripts/demo and scripts/test: make (or reuse) the project's virtual
# environment in .venv and install a requirements file into it.
#   usage: . scripts/env.sh requirements/FILE.txt [requirements/NODEPS.txt]
# The second file, if given, is installed after the first with --no-deps.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SYNCBN_VENV:-$root/.venv}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
stamp="$venv/.installed-$(basename "$1")"
if [ ! -f "$stamp" ] || [ "$root/$1" -nt "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ] \
        || { [ -n "${2:-}" ] && [ "$root/$2" -nt "$stamp" ]; }; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$root/$1"
    if [ -n "${2:-}" ]; then
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r "$root/$2"
    fi
    touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$root"
