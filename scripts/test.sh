#!/usr/bin/env bash
# The whole test suite (sets itself up first); CI runs this. `--fast`: the development tier, without the
# real model and the engine builds (docs/testing.md). Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check glance_rt export engines plugins tests scripts
if [ "${1:-}" = "--fast" ]; then
  shift
  set -- -m "not slow and not full" "$@"
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
