"""The tools around the runtime: `train` (self-distillation of a drafter), `bench` (methods side by
side), `audit` (every output against HF greedy), `suites` (prompt suites and the corpus reader)."""
