#!/usr/bin/env bash
# The whole test suite (sets itself up first). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check glance_rt export engines tests scripts
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
