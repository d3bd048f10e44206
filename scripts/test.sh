#!/usr/bin/env bash
# The README's test command: sets up .venv on first use, then runs the whole suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup_env.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest "$@"
