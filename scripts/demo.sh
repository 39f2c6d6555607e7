#!/usr/bin/env bash
# The main job on the embedded default (SmolLM2-135M-Instruct + its shipped drafter): warm up, stream
# the target's exact greedy answer drafted by GLANCE, then run the same engine autoregressively on the
# same prompt and print both speeds, tau (tokens committed per round) and that the tokens are identical.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
DEFAULT_PROMPT="Copy this paragraph exactly, then explain in two sentences what it means:
Speculative decoding lets a small draft model propose several tokens at once. The large target model then
checks all of them in a single forward pass and keeps the longest prefix it agrees with, plus one token of
its own. Because every kept token is one the target would have chosen, the output is exactly the same as
decoding with the target alone, only faster."
exec .venv/bin/glance-rt generate --compare --max-new-tokens "${MAX_NEW_TOKENS:-160}" \
  --prompt "${PROMPT:-$DEFAULT_PROMPT}" "$@"
