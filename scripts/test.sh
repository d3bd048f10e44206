#!/usr/bin/env bash
# The README's test command: sets up .venv on first use, then runs the whole suite, its tests
# spread over pytest-xdist workers (one per usable core, at most 4; VTOKEN_TEST_WORKERS=N to
# choose, 0 for one process; a later -n on the command line wins). Each worker takes whole test
# modules (--dist loadscope), so a module's fixtures (a Triton server, tensor-parallel ranks, a
# loaded engine) start once, not once on each worker that runs some of its tests.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup_env.sh"
cd "$root"
python="$root/.venv/bin/python"
workers="${VTOKEN_TEST_WORKERS:-$("$python" -c 'from trtllm_vtoken.threads import usable_cores; print(min(4, usable_cores()))')}"
# pytest caches each test module with its asserts rewritten only where bytecode may be written: a
# PYTHONDONTWRITEBYTECODE environment made every worker rewrite all of them on every run (5 s of
# the 9 s collection here). The caches sit in the checkout's ignored __pycache__ folders.
unset PYTHONDONTWRITEBYTECODE
# The real model is converted once here, not by every worker at the same time.
"$python" -c 'from trtllm_vtoken.runtime.checkpoint import ensure_default_model; ensure_default_model()'
exec "$python" -m pytest -n "$workers" --dist loadscope "$@"
