#!/usr/bin/env bash
# The main job, set-up included: `bash scripts/demo.sh [demo options]` (see `gradient-inspector demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/gradient-inspector demo "$@"
