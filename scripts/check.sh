#!/usr/bin/env bash
# Lint and format checks, set-up included: `bash scripts/check.sh`. Changes nothing; runs every
# check and fails if any failed:
#   ruff check, ruff format --check   the Python (settings in pyproject.toml)
#   prettier --check                  the JS, CSS and HTML we ship (settings in .prettierrc;
#                                     .prettierignore and .gitignore keep vendored and
#                                     installed files out: swagger-ui, .venv, node_modules)
# To apply the formatters: .venv/bin/ruff format . && node_modules/.bin/prettier --write "**/*.{js,mjs,css,html}"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --check
failed=()
.venv/bin/ruff check . || failed+=("ruff check")
.venv/bin/ruff format --check . || failed+=("ruff format --check")
node_modules/.bin/prettier --check "**/*.{js,mjs,css,html}" || failed+=("prettier --check")
if [ "${#failed[@]}" -gt 0 ]; then
    echo "check: failed: ${failed[*]}" >&2
    exit 1
fi
echo "check: all passed" >&2
