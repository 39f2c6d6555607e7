#!/usr/bin/env bash
# The test suite (sets itself up first); CI runs this with no argument: every test but the `extended` tier.
# `--fast`: the development tier (no real model, engine builds or exports); `--all`: every tier
# (docs/testing.md). Other arguments go to pytest. Two pytest workers share the machine's cores
# (GLANCE_TEST_WORKERS=N to change; 0 runs in this process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check glance_rt export engines plugins tests scripts
case "${1:-}" in
  --fast) shift; set -- -m "not slow and not full and not extended" "$@" ;;
  --all) shift ;;
  *) set -- -m "not extended" "$@" ;;
esac
workers=${GLANCE_TEST_WORKERS:-2}
if [ "$workers" != 0 ]; then
  set -- -n "$workers" --dist worksteal "$@"
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
