"""One decoding round, each step in its own module:

draft.py    the draft pass: one drafter forward fills a block of B positions
tree.py     the candidate tree (best-first over the block's marginals, prompt-lookup chains)
verify.py   the verify pass, and the passes behind one interface (eager, static/compiled, engine)
graphs.py   compiled passes replayed as CUDA graphs by a runner (static inputs, warm-up, capture, replay)
commit.py   accept (walk the tree by the target's argmax), stop rules, compaction of the KV cache
loop.py     the Decoder: prefill, then draft -> tree -> verify -> commit until a stop
adaptive.py the adaptive tree budget (a bucket per round from the entropy law)
passcheck.py each pass timed whole with its chosen kernels against the plain ones (kept only where faster)
"""
