#!/usr/bin/env bash
# The README's main-job command: sets up .venv on first use, then runs the main job.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup_env.sh"
cd "$root"
exec "$root/.venv/bin/vtoken" bench all --quick "$@"
