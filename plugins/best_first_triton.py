"""The candidate tree on a GPU: best-first search in ONE Triton program, the CUDA implementation of
`glance::best_first` (`glance_rt.round.device_tree`), equal to the host's `build_tree` bit for bit.

The torch form of the search (`best_first_device`) is a loop of small tensor ops per pop: on a GPU each
op is a kernel launch, some hundreds for a tree of 64 nodes, more time than the host heap it replaces.
Here one program keeps the whole frontier in registers and pops `BUDGET` times: the same frontier of
2*BUDGET+1 slots (pop s writes its sibling to slot 2s+1, its first child to 2s+2), the same pop (the
highest score, the lowest slot among equal scores: heapq's push order), the same float32 scores
(parent score + log-prob), the same grafting of a prompt-lookup chain; then the ancestor mask: every
node climbs its parents at once, writing its row's ancestors, for as many steps as the deepest node.

    best_first_kernel(top_lp, top_ids, chain, chain_len, tokens, parent, depth, mask)
      top_lp   *f32 [D, K]  per depth, log-probs sorted descending (`draft_topk`)
      top_ids  *i64 [D, K]  their tokens
      chain    *i64 [L]     the prompt-lookup chain, `chain_len` [] of it grafted (0: none)
      tokens, parent, depth *i64 [N+1]; mask *i1 [N+1, N+1], zeroed by the caller
    constexprs: N_DEPTH = D, WIDTH = K, N_CHAIN = L, BUDGET = N, SLOTS >= 2N+1 and NODES >= N+1 (powers of two)
    grid: (1,)
"""

import triton
import triton.language as tl

# one warp: a pop is a chain of reductions over the frontier, each a few shuffles in one warp, where
# more warps add a barrier and shared memory to every one (the second H200 run: 209 us a tree of 64 nodes
# at 4 warps)
NUM_WARPS = 1


@triton.jit
def _pick(sel, x):
    """x[i] where sel (one true lane) is true: an exact sum of one value and zeros."""
    return tl.sum(tl.where(sel, x, tl.zeros_like(x)), 0)


@triton.jit
def best_first_kernel(top_lp_ptr, top_ids_ptr, chain_ptr, len_ptr, tokens_ptr, parent_ptr, depth_ptr, mask_ptr,
                      N_DEPTH: tl.constexpr, WIDTH: tl.constexpr, N_CHAIN: tl.constexpr, BUDGET: tl.constexpr,
                      SLOTS: tl.constexpr, NODES: tl.constexpr):
    slot = tl.arange(0, SLOTS)  # [S] frontier slots
    node = tl.arange(0, NODES)  # [M] tree nodes
    graft = tl.minimum(tl.maximum(tl.load(len_ptr), 0), min(BUDGET, N_CHAIN))  # [] grafted chain nodes
    grafted = (node >= 1) & (node <= graft)
    chained = tl.load(chain_ptr + (node - 1), mask=grafted, other=0)
    tokens = tl.where(grafted, chained, 0).to(tl.int64)  # [M]; tokens[0]: the caller's root
    parent = tl.where(node == 0, -1, tl.where(grafted, node - 1, 0)).to(tl.int64)
    depth = tl.where(grafted, node, 0).to(tl.int64)
    count = (graft + 1).to(tl.int64)  # nodes so far

    live = slot == 0
    score = tl.where(slot == 0, tl.load(top_lp_ptr), 0.0)  # [S] the prefix's log-prob
    pscore = tl.zeros([SLOTS], tl.float32)  # [S] its parent prefix's
    f_depth = tl.full([SLOTS], 1, tl.int64)
    f_rank = tl.zeros([SLOTS], tl.int64)
    f_par = tl.zeros([SLOTS], tl.int64)  # the parent's node
    for step in range(BUDGET):
        active = (count <= BUDGET) & (tl.max(live.to(tl.int32), 0) > 0)
        best = tl.max(tl.where(live, score, float("-inf")), 0)
        j = tl.min(tl.where(live & (score == best), slot, 2 * BUDGET), 0)  # the pop: lowest slot of the best
        sel = slot == j
        s, ps = _pick(sel, score), _pick(sel, pscore)
        d, r, par = _pick(sel, f_depth), _pick(sel, f_rank), _pick(sel, f_par)
        live = live & (slot != j)
        tok = tl.load(top_ids_ptr + (tl.minimum(tl.maximum(d, 1), N_DEPTH) - 1) * WIDTH + tl.minimum(r, WIDTH - 1))
        at_par = tl.load(chain_ptr + tl.minimum(par, N_CHAIN - 1))
        shared = (par < graft) & (at_par == tok)  # this prefix is a grafted node: no new node
        here = tl.where(shared, par + 1, count)
        write = (node == count) & active & (shared == 0)
        tokens = tl.where(write, tok, tokens)
        parent = tl.where(write, par, parent)
        depth = tl.where(write, d, depth)
        count += (active & (shared == 0)).to(tl.int64)
        sib = slot == 2 * step + 1  # the next sibling: same depth, rank + 1
        sib_lp = tl.load(top_lp_ptr + (tl.maximum(d, 1) - 1) * WIDTH + tl.minimum(r + 1, WIDTH - 1))
        live = tl.where(sib, active & (r + 1 < WIDTH), live)
        score = tl.where(sib, ps + sib_lp, score)
        pscore = tl.where(sib, ps, pscore)
        f_depth = tl.where(sib, d, f_depth)
        f_rank = tl.where(sib, r + 1, f_rank)
        f_par = tl.where(sib, par, f_par)
        kid = slot == 2 * step + 2  # the first child: depth + 1, rank 0
        kid_lp = tl.load(top_lp_ptr + tl.minimum(d, N_DEPTH - 1) * WIDTH)
        live = tl.where(kid, active & (d < N_DEPTH), live)
        score = tl.where(kid, s + kid_lp, score)
        pscore = tl.where(kid, s, pscore)
        f_depth = tl.where(kid, d + 1, f_depth)
        f_rank = tl.where(kid, 0, f_rank)
        f_par = tl.where(kid, here, f_par)
    pad = node >= count  # rows the vocabulary or depth could not fill: copies of node 1
    first = node == 1
    tokens = tl.where(pad, _pick(first, tokens), tokens)
    parent = tl.where(pad, _pick(first, parent), parent)
    depth = tl.where(pad, _pick(first, depth), depth)
    rows = node < BUDGET + 1
    tl.store(tokens_ptr + node, tokens, mask=rows & (node > 0))  # the root's token is the caller's
    tl.store(parent_ptr + node, parent, mask=rows)
    tl.store(depth_ptr + node, depth, mask=rows)

    # the ancestor mask (zeroed by the caller): every node climbs its parents, all at once, writing
    # mask[i, a] for each ancestor a (and itself), as many steps as the deepest node
    tl.debug_barrier()  # the parents stored above, visible to every lane of the program
    anc = node.to(tl.int64)  # [M] each row's current ancestor, itself first
    for _ in range(0, tl.max(tl.where(rows, depth, 0), 0) + 1):
        up = rows & (anc >= 0)
        tl.store(mask_ptr + node * (BUDGET + 1) + anc, tl.full([NODES], 1, tl.int1), mask=up)
        anc = tl.load(parent_ptr + anc, mask=up, other=-1)


def best_first(top_lp, top_ids, chain, chain_len, root, budget: int):
    """Launch on torch tensors (CUDA, or CPU through Triton's interpreter): -> tokens, parent, depth
    [N+1] int64 (tokens[0] = root), mask [N+1, N+1] bool, as `best_first_device` + `_finish`."""
    import torch

    n_depth, width = top_lp.shape
    tokens = root.reshape(1).to(torch.int64).repeat(budget + 1)  # only tokens[0] survives: the root
    parent, depth = (torch.empty(budget + 1, dtype=torch.int64, device=top_lp.device) for _ in range(2))
    mask = torch.zeros(budget + 1, budget + 1, dtype=torch.bool, device=top_lp.device)  # the kernel sets ancestors
    best_first_kernel[(1,)](top_lp.contiguous(), top_ids.contiguous(), chain.contiguous(), chain_len.reshape(()),
                            tokens, parent, depth, mask, N_DEPTH=n_depth, WIDTH=width, N_CHAIN=chain.shape[0],
                            BUDGET=budget, SLOTS=triton.next_power_of_2(2 * budget + 1),
                            NODES=triton.next_power_of_2(budget + 1), num_warps=NUM_WARPS)
    return tokens, parent, depth, mask


def compile_aot(budget: int, n_depth: int, width: int, n_chain: int, arch: int = 90):
    """Compile the program ahead of time for one tree shape and GPUs of compute capability `arch`, with no
    GPU (proof that it lowers and assembles; not under TRITON_INTERPRET=1)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from glance_rt.plugins.tree_attention_triton import PTX_VERSION

    signature = {"top_lp_ptr": "*fp32", "top_ids_ptr": "*i64", "chain_ptr": "*i64", "len_ptr": "*i64",
                 "tokens_ptr": "*i64", "parent_ptr": "*i64", "depth_ptr": "*i64", "mask_ptr": "*i1"}
    constexprs = dict(N_DEPTH=n_depth, WIDTH=width, N_CHAIN=n_chain, BUDGET=budget,
                      SLOTS=triton.next_power_of_2(2 * budget + 1), NODES=triton.next_power_of_2(budget + 1))
    src = ASTSource(fn=best_first_kernel, signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
                    constexprs=constexprs)
    options = {"num_warps": NUM_WARPS, "ptx_version": PTX_VERSION}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
