#!/usr/bin/env bash
# The main job on the embedded default (SmolLM2-135M-Instruct + its shipped drafter): warm up, stream
# the target's exact greedy answer drafted by GLANCE, then run the same engine autoregressively on the
# same prompt and print both speeds, tau (tokens committed per round) and that the tokens are identical.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
DEFAULT_PROMPT="Convert this table to a JSON list of objects with the keys name, version and size:

name,version,size
libcbor0.8,0.8.0-2,98
libssl3,3.0.11-1,6042
zlib1g,1.2.13-1,168
libgmp10,6.2.1-3,855
libffi8,3.4.4-1,68"
exec .venv/bin/glance-rt generate --compare --max-new-tokens "${MAX_NEW_TOKENS:-128}" \
  --prompt "${PROMPT:-$DEFAULT_PROMPT}" "$@"
