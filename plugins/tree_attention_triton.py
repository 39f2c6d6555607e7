"""Tree attention on GPUs: ONE Triton kernel source, the CUDA implementation of `glance::tree_attention`
(torch, eager and compiled) and the kernel the TensorRT plugin bakes into its engines.

Contract (as `glance_rt.models.attention.tree_attention_reference`): query rows t < T of head h see
cache rows j < prefix_len, and rows prefix_len + i where tree_mask[t, i]; every other row is
invisible. The kernels read prefix_len from device memory and visit cache rows [0, prefix_len + T)
only: no host sync (a CUDA graph captures them), and the cache tail past the queries' own rows is never
read. Flash-style (online softmax over BLOCK_N-row tiles, fp32 accumulators); grouped-query heads are
folded, so one program reads each K/V tile once for the G query heads that share it. Whole tiles below
prefix_len, which every query sees, run a loop without the tree mask's loads and row bounds; the tiles
the queries' own rows reach run a second loop that reads the mask (the same tiles in the same order:
the same bits).

Split-KV (flash-decoding). A decode call has few query rows (G*T: 8 at a 3B's AR step), so one program
per (query tile, KV head) leaves most of a GPU idle while each program walks the whole prefix alone
(the first H200 run: 2 programs on 132 SMs, 102 us where reading the rows takes about 1 us). So the
cache is cut into splits of SPLIT_ROWS rows with FIXED boundaries [s*S, (s+1)*S): programs run over
(query tile, KV head, split); each writes its split's partial softmax state (running max m, sum l and
the unnormalised accumulator acc, fp32) to scratch; a combine kernel then folds the splits in order
s = 0, 1, ... (m' = max(m, m_s); l' = l e^(m-m') + l_s e^(m_s-m'); acc likewise) and normalises. The
boundaries depend on neither T nor the number of splits a call needs (the grid covers the cache's
capacity; splits past prefix_len + T exit at once and the combine folds only the live ones), and the
tiles inside a split start at its boundary, so every query row's reduction order is a function of the
cache rows alone: a verify row and an autoregressive step at the same position reduce alike, and a
longer prefix adds programs instead of lengthening one program's loop. One split's fold is exact
(e^(-1e30-m) = 0, e^0 = 1), so a cache of at most SPLIT_ROWS rows runs the direct kernel alone (no
scratch, one launch) with bit-identical results. Opt-in (`tune={"FUSED": True}`, measured on a GPU before
it becomes the default): the split kernel folds the splits itself, in the last live split's program of
each query tile (a per-tile counter), and no combine is launched; the same bits.

Batches (`glance_rt.round.batch`): a call may carry B sequences, each with its own query rows, cache
rows, tree mask and prefix length (q [B, H, T, D], k, v [B, KVH, L, D], tree_mask [B, T, T], prefix_len
[B]): the batch is one more grid axis, so one launch covers every sequence of a batched pass and a
sequence's programs are the ones it gets alone (its result is bit-identical to a call of its own).

Exact numerics (`glance_rt.models.exact`): `tree_attention(..., exact=True)` runs the PATH
kernel instead, whose every query row gets the bits an autoregressive step at its position gets once its
path is committed. The tiles above cannot give that: a tree row's ancestors lie at scattered cache rows
with other branches' rows between them (masked, p = 0, but they still change how a tile's sums group,
and where tiles and splits cut the path), while an AR step reads the same keys contiguously. A path
program serves ONE query row (its G heads, so the tile never mixes rows with other paths) and walks
positions along that row's path, j = 0, 1, ... < prefix + (rows it sees): position j reads cache row j
below the prefix and, from it on, the row of the (j - prefix)-th tree row the query sees (a running
count of its tree-mask row, in registers). Tiles start at the split boundaries by path position, a tile
is whole when every position in it is on the path, splits past a row's path hold the empty state (their
fold changes no bit: x*1 + 0). So a verify row and the AR step at the same position feed the same values
to the same code in the same order: bit for bit, in every dtype, whatever the hardware does inside a
dot. An AR step (T = 1, mask [[1]]) is a path like any other, so exact numerics run both through it.
Opt-in (`tune={"PATH_ROWS": R}`, for the GPU check to measure): a program serves R query rows, each in its
own M head slots of one [R*M, D] query tile. The whole tiles below the prefix are the same cache rows on
every row's path: read once, one dot for all rows. Then each row's further tiles, each in a dot of the
same shape whose other rows are dropped. An AR step runs the same program with one row filled, so a row
meets the same values in the same order in dots of the same shape; its bits then rest on the MMA giving
a row the same arithmetic at every row slot of a tile (true of the interpreter's row-by-row dot in the
tests; the GPU check compares rows with their AR steps on the device). A verify call of T rows reads the
prefix T/R times instead of T times.

Entry points (the first three share one body, `_attend_rows`; the path kernel walks `_attend_path`):
  tree_attention_kernel          direct: one program walks all rows and normalises (the TensorRT plugin's)
  tree_attention_split_kernel    one split's partial state per (query tile, KV head, sequence x split)
  tree_attention_combine_kernel  folds the live splits in order, normalises, writes out
  tree_attention_path_kernel     exact numerics: one query row's path per program, direct or a split's
                                 partial state (then the same combine)

Direct kernel launch ABI (TensorRT's AOT plugin order: input pointers, int32 extras, output pointers):

    tree_attention_kernel(q, k, v, tree_mask, prefix_len, T, KV_ROWS, KV_BATCH, out)
      q          *dtype  [B, H, T, D] contiguous
      k, v       *dtype  [B, KVH, L, D], rows of D contiguous elements (only the first prefix_len + T
                         rows of each sequence are read)
      tree_mask  *i1     [B, T, T] (torch.bool: one byte per entry)
      prefix_len *i64    [B] on the device
      T          i32     queries per head
      KV_ROWS    i32     the head stride of k and v, in rows (L for a contiguous cache)
      KV_BATCH   i32     their sequence stride, in rows (unread when B = 1)
      out        *dtype  [B, H, T, D] contiguous
    constexprs: GROUPS = H // KVH, HEAD_DIM = D, SCALE, BLOCK_M, BLOCK_N, BLOCK_D
    grid: (cdiv(GROUPS * T, BLOCK_M), KVH, B); block: num_warps * 32 threads

The TensorRT plugin runs the direct kernel: TensorRT's AOT plugins launch exactly one kernel and get no
workspace, so the split path (two launches, scratch) is the torch op's (docs/engines.md).

fp32 runs its dot products in IEEE fp32 (no TF32): fp32 output must match the reference, whose
tokens equal Hugging Face's. fp16/bf16 multiply in their dtype and accumulate in fp32.
"""

import triton
import triton.language as tl

ABI = ("q", "k", "v", "tree_mask", "prefix_len", "T", "KV_ROWS", "KV_BATCH", "out")  # the direct kernel's
INPUTS, EXTRAS, OUTPUTS = ABI[:5], ABI[5:8], ABI[8:]  # runtime parameters
DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}  # torch dtype name -> Triton type
NUM_WARPS = 4
PTX_VERSION = 87  # Triton 3.9's default PTX ISA (9.4) is newer than CUDA 13.0's ptxas takes: pin one both know
SPLIT_ROWS = 256  # cache rows per split (a power of two >= 16): fixed boundaries, whatever the call
# query rows per combine program: each row's fold is its own (no dot), so small tiles spread a verify
# call's combine over more programs (the second H200 run: 28 programs folded 24 splits of T = 64 rows)
COMBINE_BLOCK_M = 16
# the fused combine's fold (`tree_attention_split_kernel`, FUSED) goes over its query tile in slices of this
# many rows: folding 64 rows at once held two [64, D] fp32 states and spilled (sm_90, bf16, D = 128)
FOLD_M = tl.constexpr(COMBINE_BLOCK_M)
TREE_BITS_ROWS = 64  # trees of at most this many rows test their mask as one int64 per query row (`_attend_rows`)
M_START = tl.constexpr(-1.0e30)  # the running max before any visible row: finite, so an empty tile gives p = 0, not NaN


def blocks(head_dim: int, dtype: str, split_rows: int | None = None) -> dict:
    """Tile sizes: BLOCK_D pads the head dim to a power of two (tl.dot needs >= 16 on every side);
    BLOCK_N keeps shared memory within the 48 KiB a launch gets without opting in (TensorRT launches
    AOT kernels with the shared_mem the plugin declares), and within a split (its tiles start at the
    split's boundary). BLOCK_M is the direct kernel's; the split kernel picks its own (`split_block_m`)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    wide = (4 if dtype == "float32" else 2) * block_d  # bytes per cache row of one K or V tile
    block_n = 64 if wide <= 256 else 32 if wide <= 512 else 16
    return dict(BLOCK_M=16, BLOCK_N=min(block_n, split_rows or block_n), BLOCK_D=block_d)


def stages(head_dim: int, dtype: str) -> int:
    """Software-pipelining depth: 1 (no prefetch) where a second K/V tile would pass 48 KiB."""
    return 1 if (4 if dtype == "float32" else 2) * head_dim > 512 else 2


def split_block_m(rows: int) -> int:
    """Query rows per split program: enough for a verify call's G*T rows to share each K/V tile read
    (it comes from L2 once per query tile), few for a decode step. A row's result does not depend on
    which rows share its tile (each row's reduction runs over the cache rows alone)."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def check_split_rows(split_rows: int) -> int:
    if split_rows < 16 or split_rows & (split_rows - 1):
        raise ValueError(f"split_rows must be a power of two >= 16, got {split_rows}")
    return split_rows


@triton.jit
def _attend_rows(q, k_ptr, v_ptr, mask_ptr, kv_base, prefix, T, t, r_ok, d, d_ok, lo, hi, m_i, l_i, acc,
                 HEAD_DIM: tl.constexpr, SCALE: tl.constexpr, BLOCK_N: tl.constexpr, TREE_BITS: tl.constexpr):
    """Online softmax of query tile q [M, D] over cache rows [lo, hi) in BLOCK_N-row tiles from lo:
    updates and returns the running (m [M], l [M], acc [M, D]), all fp32. Whole tiles below the prefix
    (every query sees them) run without the tree mask and row bounds; the rest read the mask. Both loops
    visit the same tiles in the same order, and a tile every row sees gives the same bits either way.

    TREE_BITS (T <= 64): each query row's tree-mask row is read once, before the loops, as the bits of one
    int64, and a tile tests its columns' bits; else a tile gathers its [M, N] mask entries from memory.
    The same visibility either way (the same bits out), but the gather's M x N pointers and bytes, held
    by the pipeliner for the next tile, cost registers: at a 7B's shapes (bf16, sm_90, 4 warps) 168
    against 96 a thread with 16 query rows, and 255 plus 404 bytes of spills against 216 with 64
    (`scripts/kernel_resources.py`)."""
    full = lo + tl.maximum(tl.minimum(prefix, hi) - lo, 0) // BLOCK_N * BLOCK_N  # end of the whole prefix tiles
    for start in range(lo, full, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)  # [N] cache rows, all < prefix
        k, v = _kv_tile(k_ptr, v_ptr, kv_base, j, d, j < full, d_ok, HEAD_DIM, True)
        s = _scores(q, k, SCALE)  # [M, N] fp32
        m_i, l_i, acc = _fold_tile(s, v, m_i, l_i, acc)
    if TREE_BITS:
        # [M] int64; read only where a tile reaches the tree
        bits = _tree_bits(mask_ptr, T, tl.where(hi > prefix, T, 0), t, r_ok)
    for start in range(full, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)  # [N] cache rows
        j_ok = j < hi
        k, v = _kv_tile(k_ptr, v_ptr, kv_base, j, d, j_ok, d_ok, HEAD_DIM, False)
        s = _scores(q, k, SCALE)
        i = j - prefix  # [N] tree column of a row the queries wrote
        in_tree = (i >= 0) & j_ok
        if TREE_BITS:
            tm = (bits[:, None] >> (i & 63).to(tl.int64)[None, :]) & in_tree[None, :].to(tl.int64)  # [M, N] 0/1
        else:
            tm = tl.load(mask_ptr + t[:, None] * T + i[None, :], mask=r_ok[:, None] & in_tree[None, :], other=0)
        visible = (j < prefix)[None, :] | (tm != 0)  # [M, N]
        m_i, l_i, acc = _fold_tile(tl.where(visible, s, float("-inf")), v, m_i, l_i, acc)
    return m_i, l_i, acc


@triton.jit
def _tree_bits(mask_ptr, T, cols, t, r_ok):
    """Tree-mask rows t [M] (T <= 64 columns) as the bits of an int64 each: bit c = row t sees tree row c,
    for c < cols (the rest 0, unread)."""
    c = tl.arange(0, 64)  # [64] tree columns
    seen = tl.load(mask_ptr + t[:, None] * T + c[None, :], mask=r_ok[:, None] & (c < cols)[None, :], other=0)  # [M, 64]
    return tl.sum(seen.to(tl.int64) << c.to(tl.int64)[None, :], 1)  # bits are disjoint: the sum is their OR


@triton.jit
def _attend_path(q, k_ptr, v_ptr, mask_ptr, kv_base, prefix, T, first, slot_row, lo, lim, d, d_ok, m_i, l_i, acc,
                 HEAD_DIM: tl.constexpr, SCALE: tl.constexpr, SPLIT_ROWS: tl.constexpr, PARTIAL: tl.constexpr,
                 PATH_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """Online softmax of query rows first .. first + PATH_ROWS - 1, each along its own path, from path
    position lo (to the split's end where PARTIAL, else to the path's end): q [R*M, D] holds each row's
    heads in M slots (`slot_row` [R*M]: the row of a slot, 0..R-1), the state likewise. Tiles start at lo
    and step BLOCK_N. Whole tiles below `lim` (the prefix, or the split's end if sooner) are the same cache
    rows on every row's path: read once, their scores taken for all rows in one dot. Then each row in
    turn: its further whole tiles and the one its path ends in (`_path_rows` maps positions to cache rows;
    the last one bounded), each in one dot of the same [R*M, D] shape whose other rows' results are
    dropped (`tl.where` keeps the row's slots). So a row meets the same tiles, in the same order, in dots
    of the same shape, whatever the other rows are: an AR step (T = 1, the other slots empty) gives its
    bits. Whole tiles run without bounds, which depends on the positions alone."""
    shared = lo + tl.maximum(lim - lo, 0) // BLOCK_N * BLOCK_N  # end of the whole tiles every path shares
    for start in range(lo, shared, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)  # [N] cache rows, all < prefix
        k, v = _kv_tile(k_ptr, v_ptr, kv_base, j, d, j < shared, d_ok, HEAD_DIM, True)
        m_i, l_i, acc = _fold_tile(_scores(q, k, SCALE), v, m_i, l_i, acc)
    c = tl.arange(0, BLOCK_T)  # [BT] tree columns
    for i in tl.static_range(PATH_ROWS):
        t = first + i
        if t < T:
            seen = tl.load(mask_ptr + t * T + c, mask=c < T, other=0).to(tl.int32)  # [BT] the rows row t sees
            counts = tl.cumsum(seen, 0)  # [BT]
            end = prefix + tl.sum(seen, 0)  # the path's length: prefix, ancestors, itself
            hi = tl.minimum(lo + SPLIT_ROWS, end) if PARTIAL else end
            mine = slot_row == i  # [R*M]
            for start in range(shared, hi, BLOCK_N):  # whole tiles, then the one the path ends in
                j = start + tl.arange(0, BLOCK_N)  # [N] path positions
                j_ok = j < hi
                k, v = _kv_tile(k_ptr, v_ptr, kv_base, _path_rows(j, prefix, counts, c < T), d, j_ok, d_ok,
                                HEAD_DIM, False)
                s = tl.where(j_ok[None, :], _scores(q, k, SCALE), float("-inf"))  # [R*M, N]; whole tiles: all kept
                m_new, l_new, acc_new = _fold_tile(s, v, m_i, l_i, acc)
                m_i, l_i = tl.where(mine, m_new, m_i), tl.where(mine, l_new, l_i)
                acc = tl.where(mine[:, None], acc_new, acc)
    return m_i, l_i, acc


@triton.jit
def _path_rows(j, prefix, counts, c_ok):
    """Cache rows of path positions j [N]: j below the prefix; from it, prefix + the tree column of the
    query's (j - prefix)-th visible tree row, i.e. the number of columns c < T whose running count of
    visible entries `counts` [BT] is <= j - prefix."""
    i = j - prefix  # [N]
    col = tl.sum(((counts[None, :] <= i[:, None]) & c_ok[None, :]).to(tl.int32), 1)  # [N]
    return tl.where(i < 0, j, prefix + col)


@triton.jit
def _kv_tile(k_ptr, v_ptr, kv_base, j, d, j_ok, d_ok, HEAD_DIM: tl.constexpr, WHOLE: tl.constexpr):
    """K and V rows j [N] -> [N, D] each (0 past the head dim; past j_ok too unless the tile is WHOLE)."""
    kv_off = kv_base + j[:, None] * HEAD_DIM + d[None, :]  # [N, D]
    kv_mask = d_ok[None, :] if WHOLE else j_ok[:, None] & d_ok[None, :]
    return tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0), tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)


@triton.jit
def _scores(q, k, SCALE: tl.constexpr):
    """q [M, D] . k [N, D] -> [M, N] fp32 (IEEE fp32 products for fp32 inputs: no TF32)."""
    precision: tl.constexpr = "ieee" if k.dtype == tl.float32 else "tf32"  # tf32: ignored off fp32
    return tl.dot(q, tl.trans(k), input_precision=precision) * SCALE


@triton.jit
def _fold_tile(s, v, m_i, l_i, acc):
    """One tile's scores s [M, N] (-inf where invisible) and values v [N, D] into the running state."""
    precision: tl.constexpr = "ieee" if v.dtype == tl.float32 else "tf32"
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])  # [M, N]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=precision)
    return m_new, l_i, acc


@triton.jit
def _empty_state(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The running (m, l, acc) before any row: m finite (an empty tile gives p = 0, not NaN), l and acc 0."""
    return (tl.full([BLOCK_M], M_START, tl.float32), tl.zeros([BLOCK_M], tl.float32),
            tl.zeros([BLOCK_M, BLOCK_D], tl.float32))


@triton.jit
def _store_out(out_ptr, q_off, acc, l_i, ok):
    """Normalise the state and store it in the output's dtype at q_off [M, D] where `ok`."""
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _store_partial(acc_ptr, ml_ptr, part, d, r_ok, d_ok, m_i, l_i, acc, HEAD_DIM: tl.constexpr):
    """A split's state into the scratch rows `part` [M] (acc [.., D], ml [.., 2]; fp32)."""
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=r_ok[:, None] & d_ok[None, :])
    tl.store(ml_ptr + part * 2, m_i, mask=r_ok)
    tl.store(ml_ptr + part * 2 + 1, l_i, mask=r_ok)


@triton.jit
def _query_tile(seq, T, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """This program's folded query rows of its KV head (program_id 1) in sequence `seq`: head kvh*G + r // T,
    query r % T. -> (r [M], t [M], d [D], r_ok, d_ok, q_off [M, D]); the G heads of a KV head are
    adjacent in q, and a sequence's H heads follow the previous sequence's."""
    head = seq * tl.num_programs(1) + tl.program_id(1)  # the (sequence, KV head) pair
    return _tile_rows(head, tl.program_id(0) * BLOCK_M, T, GROUPS, HEAD_DIM, BLOCK_M, BLOCK_D)


@triton.jit
def _tile_rows(head, first, T, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """Folded query rows first .. first + BLOCK_M - 1 of the (sequence, KV head) pair `head`, as `_query_tile`."""
    rows = GROUPS * T
    r = first + tl.arange(0, BLOCK_M)  # [M]
    d = tl.arange(0, BLOCK_D)  # [D]
    q_off = (head.to(tl.int64) * rows + r)[:, None] * HEAD_DIM + d[None, :]
    return r, r % T, d, r < rows, d < HEAD_DIM, q_off


@triton.jit
def _sequence(seq, mask_ptr, prefix_ptr, T, KV_ROWS, KV_BATCH, HEAD_DIM: tl.constexpr):
    """Sequence `seq`'s tree mask, prefix length and the offset of its KV head's (program_id 1) cache rows."""
    kv_base = (seq.to(tl.int64) * KV_BATCH + tl.program_id(1).to(tl.int64) * KV_ROWS) * HEAD_DIM
    return mask_ptr + seq.to(tl.int64) * T * T, tl.load(prefix_ptr + seq).to(tl.int32), kv_base


@triton.jit
def tree_attention_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, prefix_ptr, T, KV_ROWS, KV_BATCH, out_ptr,
                          GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, SCALE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          TREE_BITS: tl.constexpr = False):
    seq = tl.program_id(2)
    r, t, d, r_ok, d_ok, q_off = _query_tile(seq, T, GROUPS, HEAD_DIM, BLOCK_M, BLOCK_D)
    q = tl.load(q_ptr + q_off, mask=r_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
    mask_ptr, prefix, kv_base = _sequence(seq, mask_ptr, prefix_ptr, T, KV_ROWS, KV_BATCH, HEAD_DIM)
    m_i, l_i, acc = _empty_state(BLOCK_M, BLOCK_D)
    m_i, l_i, acc = _attend_rows(q, k_ptr, v_ptr, mask_ptr, kv_base, prefix, T, t, r_ok, d, d_ok, 0, prefix + T,
                                 m_i, l_i, acc, HEAD_DIM, SCALE, BLOCK_N, TREE_BITS)  # rows past prefix + T: unread
    _store_out(out_ptr, q_off, acc, l_i, r_ok[:, None] & d_ok[None, :])


@triton.jit
def tree_attention_split_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, prefix_ptr, T, KV_ROWS, KV_BATCH, SPLITS,
                                acc_ptr, ml_ptr, out_ptr, count_ptr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr,
                                SCALE: tl.constexpr, SPLIT_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TREE_BITS: tl.constexpr = False,
                                FUSED: tl.constexpr = False):
    """One split's partial state (program_id(2) = sequence * SPLITS + split) for one query tile of one KV
    head, into scratch laid out as acc [B, KVH, SPLITS, G*T, D] and ml [B, KVH, SPLITS, G*T, 2] (fp32).

    FUSED: no combine launch. Each live split's program counts itself in its query tile's counter
    (count_ptr [B, KVH, tiles] int32, zero before the launch) once its state is stored; the one that
    counts last folds the tile's live splits in split order, as the combine kernel does (the same bits),
    writes out [B, H, T, D] and sets the counter back to 0 for the next launch. The stores are ordered
    before the count by a barrier and the count's release; the last program's loads come after its
    acquire, from L2 (".cg"). Unused otherwise (out_ptr, count_ptr: any pointer)."""
    seq, split = tl.program_id(2) // SPLITS, tl.program_id(2) % SPLITS
    mask_ptr, prefix, kv_base = _sequence(seq, mask_ptr, prefix_ptr, T, KV_ROWS, KV_BATCH, HEAD_DIM)
    lo = split * SPLIT_ROWS
    if lo < prefix + T:  # a split past the queries' own rows has nothing to read (and the combine skips it)
        r, t, d, r_ok, d_ok, q_off = _query_tile(seq, T, GROUPS, HEAD_DIM, BLOCK_M, BLOCK_D)
        q = tl.load(q_ptr + q_off, mask=r_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
        m_i, l_i, acc = _empty_state(BLOCK_M, BLOCK_D)
        hi = tl.minimum(lo + SPLIT_ROWS, prefix + T)
        m_i, l_i, acc = _attend_rows(q, k_ptr, v_ptr, mask_ptr, kv_base, prefix, T, t, r_ok, d, d_ok, lo, hi,
                                     m_i, l_i, acc, HEAD_DIM, SCALE, BLOCK_N, TREE_BITS)
        head = seq * tl.num_programs(1) + tl.program_id(1)  # the (sequence, KV head) pair
        part = (head.to(tl.int64) * SPLITS + split) * (GROUPS * T) + r  # [M] rows of the scratch
        _store_partial(acc_ptr, ml_ptr, part, d, r_ok, d_ok, m_i, l_i, acc, HEAD_DIM)
        if FUSED:
            live = tl.cdiv(prefix + T, SPLIT_ROWS)
            counter = count_ptr + head.to(tl.int64) * tl.num_programs(0) + tl.program_id(0)  # this query tile's
            tl.debug_barrier()  # every thread's stores issued before the count releases them
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == live - 1:  # the last live split
                # in FOLD_M-row slices of the tile: a slice's state in registers, not the whole tile's twice
                for first in tl.static_range(0, BLOCK_M, FOLD_M):
                    rs, _, d, rs_ok, d_ok, qs_off = _tile_rows(head, tl.program_id(0) * BLOCK_M + first, T, GROUPS,
                                                               HEAD_DIM, FOLD_M, BLOCK_D)
                    _fold_splits(acc_ptr, ml_ptr, out_ptr, head, SPLITS, live, GROUPS * T, rs, d, rs_ok, d_ok, qs_off,
                                 HEAD_DIM, FOLD_M, BLOCK_D, ".cg")
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def tree_attention_combine_kernel(acc_ptr, ml_ptr, prefix_ptr, T, SPLITS, out_ptr,
                                  GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT_ROWS: tl.constexpr,
                                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Fold the live splits' partial states of sequence program_id(2) in split order and normalise: out
    [B, H, T, D]."""
    seq = tl.program_id(2)
    r, t, d, r_ok, d_ok, q_off = _query_tile(seq, T, GROUPS, HEAD_DIM, BLOCK_M, BLOCK_D)
    head = seq * tl.num_programs(1) + tl.program_id(1)  # the (sequence, KV head) pair
    live = tl.cdiv(tl.load(prefix_ptr + seq).to(tl.int32) + T, SPLIT_ROWS)
    _fold_splits(acc_ptr, ml_ptr, out_ptr, head, SPLITS, live, GROUPS * T, r, d, r_ok, d_ok, q_off, HEAD_DIM,
                 BLOCK_M, BLOCK_D, "")


@triton.jit
def _fold_splits(acc_ptr, ml_ptr, out_ptr, head, SPLITS, live, rows, r, d, r_ok, d_ok, q_off,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, CACHE: tl.constexpr):
    """Fold the partial states of splits 0..live-1 of the (sequence, KV head) `head`'s folded rows r [M]
    (of `rows`) in split order, normalise and store them at q_off. `CACHE`: the loads' cache modifier
    (".cg": from L2, for states other programs of the same launch wrote)."""
    m_i, l_i, acc = _empty_state(BLOCK_M, BLOCK_D)
    for split in range(0, live):
        part = (head.to(tl.int64) * SPLITS + split) * rows + r  # [M]
        m_s = tl.load(ml_ptr + part * 2, mask=r_ok, other=M_START, cache_modifier=CACHE)
        l_s = tl.load(ml_ptr + part * 2 + 1, mask=r_ok, other=0.0, cache_modifier=CACHE)
        acc_s = tl.load(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=r_ok[:, None] & d_ok[None, :],
                        other=0.0, cache_modifier=CACHE)
        m_new = tl.maximum(m_i, m_s)
        alpha, beta = tl.exp(m_i - m_new), tl.exp(m_s - m_new)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m_i = m_new
    _store_out(out_ptr, q_off, acc, l_i, r_ok[:, None] & d_ok[None, :])


@triton.jit
def tree_attention_path_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, prefix_ptr, T, KV_ROWS, KV_BATCH, SPLITS,
                               out_ptr, acc_ptr, ml_ptr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr,
                               SCALE: tl.constexpr, SPLIT_ROWS: tl.constexpr, PARTIAL: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                               BLOCK_T: tl.constexpr, PATH_ROWS: tl.constexpr = 1):
    """Exact numerics: query rows group * PATH_ROWS .. + PATH_ROWS - 1, heads [tile * BLOCK_M, ...) of one
    KV head (program_id(0) = group * head tiles + tile), each along its own path (`_attend_path`). PARTIAL:
    split program_id(2) % SPLITS's state into the split kernel's scratch (the combine kernel folds it);
    else the whole path, normalised, into out."""
    seq, split = tl.program_id(2) // SPLITS, tl.program_id(2) % SPLITS
    mask_ptr, prefix, kv_base = _sequence(seq, mask_ptr, prefix_ptr, T, KV_ROWS, KV_BATCH, HEAD_DIM)
    lo = split * SPLIT_ROWS
    if lo < prefix + T:  # as the split kernel: the combine folds these splits (past the row's path: empty)
        tiles: tl.constexpr = (GROUPS + BLOCK_M - 1) // BLOCK_M
        first = tl.program_id(0) // tiles * PATH_ROWS  # the group's first query row
        slot = tl.arange(0, PATH_ROWS * BLOCK_M)  # [R*M]: M head slots per row
        t = first + slot // BLOCK_M  # [R*M] query row of each slot
        g = tl.program_id(0) % tiles * BLOCK_M + slot % BLOCK_M  # [R*M] heads of this KV head
        r = g * T + t  # [R*M] folded rows (as `_query_tile`'s: head kvh*G + g, query t)
        d = tl.arange(0, BLOCK_D)
        r_ok, d_ok = (g < GROUPS) & (t < T), d < HEAD_DIM
        head = seq * tl.num_programs(1) + tl.program_id(1)  # the (sequence, KV head) pair
        q_off = (head.to(tl.int64) * (GROUPS * T) + r)[:, None] * HEAD_DIM + d[None, :]
        q = tl.load(q_ptr + q_off, mask=r_ok[:, None] & d_ok[None, :], other=0.0)  # [R*M, D]
        m_i, l_i, acc = _empty_state(PATH_ROWS * BLOCK_M, BLOCK_D)
        lim = tl.minimum(prefix, lo + SPLIT_ROWS) if PARTIAL else prefix  # below it: every path's own rows
        m_i, l_i, acc = _attend_path(q, k_ptr, v_ptr, mask_ptr, kv_base, prefix, T, first, slot // BLOCK_M, lo, lim,
                                     d, d_ok, m_i, l_i, acc, HEAD_DIM, SCALE, SPLIT_ROWS, PARTIAL, PATH_ROWS,
                                     BLOCK_N, BLOCK_T)
        if PARTIAL:
            part = (head.to(tl.int64) * SPLITS + split) * (GROUPS * T) + r  # [R*M] rows of the scratch
            _store_partial(acc_ptr, ml_ptr, part, d, r_ok, d_ok, m_i, l_i, acc, HEAD_DIM)
        else:
            _store_out(out_ptr, q_off, acc, l_i, r_ok[:, None] & d_ok[None, :])


def grid(rows, kv_heads: int, block_m: int, sequences: int = 1) -> tuple:
    """Programs for GROUPS * T folded query rows over kv_heads KV heads and `sequences` (for the split
    kernel: sequences x cache splits). `rows` may be symbolic (the TensorRT plugin's expression of a
    dynamic T): the ceiling division is written in + and // alone, the expression on the left, which
    both support."""
    return ((rows + (block_m - 1)) // block_m, kv_heads, sequences)


def direct_launch(batch, heads: int, rows, kv_heads: int, kv_rows, block_m: int) -> tuple[tuple, tuple]:
    """The direct kernel's grid and int32 extras (T, KV_ROWS, KV_BATCH) over q [B, H, T, D] and k, v
    [B, KVH, L, D] packed (what a graph hands a plugin: a batch's cache slots as one dense tensor) ->
    (grid, extras). `batch`, `rows` and `kv_rows` may be symbolic (the TensorRT plugin's shape
    expressions of B, T and L): only + * // with the expression on the left are used (`grid`)."""
    return grid(rows * (heads // kv_heads), kv_heads, block_m, batch), (rows, kv_rows, kv_rows * kv_heads)


def tree_attention(q, k, v, tree_mask, prefix_len, scale: float, split_rows: int | None = SPLIT_ROWS,
                   block_m: int | None = None, tune: dict | None = None, exact: bool = False):
    """Launch on torch tensors: CUDA, or CPU tensors through Triton's interpreter (with
    TRITON_INTERPRET=1 set before triton is first imported, as the tests do). Shapes as the op (one
    sequence: q [1, H, T, D], tree_mask [T, T], prefix_len []; or B: [B, H, T, D], [B, T, T], [B]); k and v
    may be views of a larger cache (any head and sequence strides: a batch's cache slots), q any layout.
    -> [B, H, T, D].

    The cache's L = k.shape[2] rows are cut into cdiv(L, split_rows) splits (split-KV: split kernel, then
    combine); `split_rows` None, or L <= split_rows, runs the direct kernel alone. `block_m`: the split
    kernel's query rows per program (None: `split_block_m`); it changes no result. `tune`: launch
    settings to measure (gpu_check's sweep), any of BLOCK_N (tile rows: it changes the reduction order,
    so the op keeps `blocks`' one per dtype and head dim), num_warps, num_stages, TREE_BITS (False: the
    tree mask gathered per tile), FUSED (True: the split kernel folds the splits itself, no combine
    launch; same bits; not yet the op's default: measured by the GPU check first), PATH_ROWS (exact: query
    rows per path program, default 1; an AR step and its verify rows need the same). `exact`: the path
    kernel (exact numerics: every row the bits of the AR step at its position; `block_m` unused)."""
    import torch

    seqs, heads, t, d = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    groups, dtype = heads // kv_heads, str(q.dtype).removeprefix("torch.")
    q = q.contiguous()
    if k.stride(3) != 1 or k.stride(2) != d or v.stride() != k.stride():
        k, v = k.contiguous(), v.contiguous()
    out = torch.empty_like(q)  # [B, H, T, D]
    prefix = prefix_len.reshape(seqs).to(torch.int64).contiguous()  # [B] (a batch's: a column of its rows)
    mask = tree_mask.contiguous()  # [B, T, T] (or [T, T]: B = 1)
    strides = (k.stride(1) // d, k.stride(0) // d)  # KV_ROWS, KV_BATCH: head and sequence strides in rows
    tune = dict(tune or {})
    fused = tune.pop("FUSED", False)  # the split kernel folds the splits itself (no combine launch)
    common = dict(GROUPS=groups, HEAD_DIM=d, num_warps=tune.pop("num_warps", NUM_WARPS),
                  num_stages=tune.pop("num_stages", stages(d, dtype)))
    splits = 1 if split_rows is None else triton.cdiv(kv_len, check_split_rows(split_rows))
    if exact:
        return _path_attention(q, k, v, mask, prefix, t, strides, out, splits, split_rows, float(scale),
                               blocks(d, dtype, split_rows) | tune, common)
    bits = dict(TREE_BITS=t <= TREE_BITS_ROWS)
    if splits == 1:
        tiles = blocks(d, dtype) | bits | tune
        tree_attention_kernel[grid(groups * t, kv_heads, tiles["BLOCK_M"], seqs)](
            q, k, v, mask, prefix, t, *strides, out, SCALE=float(scale), **tiles, **common)
        return out
    tiles = blocks(d, dtype, split_rows) | bits | tune
    tiles["BLOCK_M"] = block_m or split_block_m(groups * t)
    if fused and tiles["BLOCK_M"] % COMBINE_BLOCK_M:
        raise ValueError(f"the fused combine folds {COMBINE_BLOCK_M}-row slices of a query tile: block_m must be "
                         f"a multiple of {COMBINE_BLOCK_M}, got {tiles['BLOCK_M']}")
    acc, ml = _scratch(q, kv_heads, splits)
    programs = grid(groups * t, kv_heads, tiles["BLOCK_M"], seqs * splits)
    count = _counters(q.device, seqs * kv_heads * programs[0]) if fused else acc
    tree_attention_split_kernel[programs](
        q, k, v, mask, prefix, t, *strides, splits, acc, ml, out, count, SCALE=float(scale), SPLIT_ROWS=split_rows,
        FUSED=fused, **tiles, **common)
    return out if fused else _combine(acc, ml, prefix, t, out, split_rows, tiles, common)


def _counters(device, n: int):
    """The fused combine's per-tile counters on `device`: at least n int32 zeros, allocated once and kept
    (each launch's last programs set theirs back to 0), so a CUDA graph captures no fill; the first call
    must come before any capture (a warm-up), and calls that share a device must not overlap on two
    streams."""
    import torch

    have = _COUNTERS.get(str(device))
    if have is None or have.numel() < n:
        have = _COUNTERS[str(device)] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return have


_COUNTERS: dict = {}  # device -> the fused combine's counters (`_counters`)


def _scratch(q, kv_heads: int, splits: int) -> tuple:
    """The splits' partial states: acc [B, KVH, SPLITS, G*T, D] and ml [B, KVH, SPLITS, G*T, 2], fp32."""
    import torch

    seqs, heads, t, d = q.shape
    rows = heads // kv_heads * t
    return (torch.empty(seqs, kv_heads, splits, rows, d, dtype=torch.float32, device=q.device),
            torch.empty(seqs, kv_heads, splits, rows, 2, dtype=torch.float32, device=q.device))


def _combine(acc, ml, prefix, t: int, out, split_rows: int, tiles: dict, common: dict):
    """The combine kernel over the scratch `_scratch` made (rows fold independently: small query tiles)."""
    seqs, kv_heads, splits, rows = acc.shape[:4]
    tree_attention_combine_kernel[grid(rows, kv_heads, COMBINE_BLOCK_M, seqs)](
        acc, ml, prefix, t, splits, out, SPLIT_ROWS=split_rows, BLOCK_M=COMBINE_BLOCK_M,
        BLOCK_D=tiles["BLOCK_D"], **common)
    return out


def _path_attention(q, k, v, mask, prefix, t: int, strides: tuple, out, splits: int, split_rows: int | None,
                    scale: float, tiles: dict, common: dict):
    """`tree_attention(..., exact=True)`'s launches: the path kernel over (query row x head tile, KV head,
    sequence x split), then the combine kernel where the cache has several splits."""
    seqs, kv_heads, groups = q.shape[0], k.shape[1], common["GROUPS"]
    rows = triton.cdiv(t, tiles.get("PATH_ROWS", 1)) * triton.cdiv(groups, tiles["BLOCK_M"])  # row groups x head tiles
    path = dict(SCALE=scale, SPLIT_ROWS=split_rows or 0, PARTIAL=splits > 1,
                BLOCK_T=max(16, triton.next_power_of_2(t)), **tiles, **common)
    if splits == 1:
        tree_attention_path_kernel[(rows, kv_heads, seqs)](q, k, v, mask, prefix, t, *strides, 1, out, out, out, **path)
        return out
    acc, ml = _scratch(q, kv_heads, splits)
    tree_attention_path_kernel[(rows, kv_heads, seqs * splits)](q, k, v, mask, prefix, t, *strides, splits, out,
                                                                acc, ml, **path)
    return _combine(acc, ml, prefix, t, out, split_rows, tiles, common)


def compile_aot(dtype: str, head_dim: int, groups: int, scale: float, arch: int = 90):
    """Compile the direct kernel ahead of time for one dtype ("float32", "float16", "bfloat16") and shape
    family, for GPUs of compute capability `arch` (80: A100, 90: H100/H200), with no GPU: returns
    Triton's compiled kernel (`.asm["ptx"]`, `.asm["cubin"]`, `.metadata.name`, `.metadata.shared`).
    T, KV_ROWS and KV_BATCH stay runtime int32 parameters (no value specialisation), as the plugin passes them.
    Not under TRITON_INTERPRET=1 (the interpreter replaces Triton's language: nothing compiles)."""
    ty = DTYPES[dtype]
    signature = {"q_ptr": f"*{ty}", "k_ptr": f"*{ty}", "v_ptr": f"*{ty}", "mask_ptr": "*i1", "prefix_ptr": "*i64",
                 "T": "i32", "KV_ROWS": "i32", "KV_BATCH": "i32", "out_ptr": f"*{ty}"}
    constexprs = dict(GROUPS=groups, HEAD_DIM=head_dim, SCALE=float(scale), **blocks(head_dim, dtype),
                      TREE_BITS=False)  # the plugin's T is any: the mask is gathered
    return _compile(tree_attention_kernel, signature, constexprs, arch, stages(head_dim, dtype))


def compile_split_aot(dtype: str, head_dim: int, groups: int, scale: float, arch: int = 90,
                      split_rows: int = SPLIT_ROWS, block_m: int = 16, tree_bits: bool = True,
                      tune: dict | None = None, aligned: bool = False, fused: bool = False) -> tuple:
    """The split-KV pair (split kernel, combine kernel) compiled ahead of time as `compile_aot` does:
    proof with no GPU that both lower to PTX and assemble for `arch`. `tune`: BLOCK_N, num_warps,
    num_stages as `tree_attention` takes them; `fused`: its FUSED (the combine folded in). `aligned`:
    pointers 16-byte aligned and the cache's row strides multiples of 16, as Triton's JIT specialises a
    launch on torch tensors and a cache of a multiple of 16 rows (vectorised loads), so the registers
    and spills `ptxas` reports for it are the op's on a GPU (`scripts/kernel_resources.py`)."""
    ty = DTYPES[dtype]
    tune = dict(tune or {})
    warps, n_stages = tune.pop("num_warps", NUM_WARPS), tune.pop("num_stages", stages(head_dim, dtype))
    tiles = {**blocks(head_dim, dtype, check_split_rows(split_rows)), "BLOCK_M": block_m, **tune}
    split = _compile(tree_attention_split_kernel,
                     {"q_ptr": f"*{ty}", "k_ptr": f"*{ty}", "v_ptr": f"*{ty}", "mask_ptr": "*i1",
                      "prefix_ptr": "*i64", "T": "i32", "KV_ROWS": "i32", "KV_BATCH": "i32", "SPLITS": "i32",
                      "acc_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": f"*{ty}", "count_ptr": "*i32"},
                     dict(GROUPS=groups, HEAD_DIM=head_dim, SCALE=float(scale), SPLIT_ROWS=split_rows,
                          TREE_BITS=tree_bits, FUSED=fused, **tiles), arch, n_stages, warps, aligned,
                     ("KV_ROWS", "KV_BATCH"))
    combine = _compile(tree_attention_combine_kernel,
                       {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "prefix_ptr": "*i64", "T": "i32", "SPLITS": "i32",
                        "out_ptr": f"*{ty}"},
                       dict(GROUPS=groups, HEAD_DIM=head_dim, SPLIT_ROWS=split_rows, BLOCK_M=block_m,
                            BLOCK_D=tiles["BLOCK_D"]), arch, 1, NUM_WARPS, aligned)
    return split, combine


def compile_path_aot(dtype: str, head_dim: int, groups: int, scale: float, arch: int = 90,
                     split_rows: int = SPLIT_ROWS, partial: bool = True, block_t: int = 16, aligned: bool = False,
                     path_rows: int = 1):
    """The path kernel (exact numerics) compiled ahead of time as `compile_aot` does: a split's partial
    state (`partial`) or the direct form, for trees of up to `block_t` rows, `path_rows` query rows a
    program (`aligned`: as `compile_split_aot`)."""
    ty = DTYPES[dtype]
    signature = {"q_ptr": f"*{ty}", "k_ptr": f"*{ty}", "v_ptr": f"*{ty}", "mask_ptr": "*i1", "prefix_ptr": "*i64",
                 "T": "i32", "KV_ROWS": "i32", "KV_BATCH": "i32", "SPLITS": "i32", "out_ptr": f"*{ty}",
                 "acc_ptr": "*fp32", "ml_ptr": "*fp32"}
    constexprs = dict(GROUPS=groups, HEAD_DIM=head_dim, SCALE=float(scale), SPLIT_ROWS=split_rows,
                      PARTIAL=partial, **blocks(head_dim, dtype, check_split_rows(split_rows)), BLOCK_T=block_t,
                      PATH_ROWS=path_rows)
    return _compile(tree_attention_path_kernel, signature, constexprs, arch, stages(head_dim, dtype), NUM_WARPS,
                    aligned, ("KV_ROWS", "KV_BATCH"))


def _compile(fn, signature: dict, constexprs: dict, arch: int, num_stages: int, num_warps: int = NUM_WARPS,
             aligned: bool = False, multiples: tuple = ()):
    """`aligned`: every pointer argument 16-byte aligned, and the int arguments named in `multiples`
    multiples of 16 (Triton's `tt.divisibility` hints: what its JIT specialises a launch on, for a torch
    tensor's data pointer and such an int), so the code is what a GPU launch runs (vectorised, pipelined
    loads); off for the plugin, whose pointers and shapes TensorRT hands over."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(signature.items())
             if ty.startswith("*") or name in multiples}
    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs if aligned else None)
    options = {"num_warps": num_warps, "num_stages": num_stages, "ptx_version": PTX_VERSION,
               "enable_fp_fusion": True}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


PTX_PARAM = {"ptr": "u64", "i32": "u32"}
HIDDEN = ("global_scratch_size", "profile_scratch_size")  # Triton >= 3.3 appends one pointer param per kind


def check_abi(ptx: str, name: str, shared: int, scratch: dict) -> list[str]:
    """Check a compiled kernel (its PTX, entry name, shared memory bytes and Triton's hidden scratch
    sizes, as `describe` gives them) against the launch ABI the TensorRT plugin declares: the PTX
    entry takes the ABI's parameters in order (pointers as .u64, int32 extras as .u32), then only
    Triton's hidden scratch pointers, whose sizes must be 0 (the kernel never dereferences them;
    TensorRT allocates no scratch), and the shared memory fits a launch without opt-in. Returns the
    PTX parameter types; raises ValueError naming the mismatch."""
    import re

    entry = re.search(r"\.entry\s+(\w+)\s*\(([^)]*)\)", ptx)
    if entry is None or entry.group(1) != name:
        raise ValueError(f"no .entry {name} in the PTX")
    types = [re.match(r"\s*\.param\s+\.(\w+)", p).group(1) for p in entry.group(2).split(",") if p.strip()]
    want = [PTX_PARAM["ptr"]] * len(INPUTS) + [PTX_PARAM["i32"]] * len(EXTRAS) + [PTX_PARAM["ptr"]] * len(OUTPUTS)
    if types[: len(want)] != want:
        raise ValueError(f"PTX parameters {types} do not start with the ABI's {want} ({', '.join(ABI)})")
    extra = types[len(want) :]
    if len(extra) > len(HIDDEN) or any(t != PTX_PARAM["ptr"] for t in extra):
        raise ValueError(f"PTX parameters past the ABI's are not Triton's hidden scratch pointers: {extra}")
    if any(scratch.values()):
        raise ValueError(f"the kernel needs scratch memory the plugin does not allocate: {scratch}")
    if shared > 48 * 1024:
        raise ValueError(f"{shared} bytes of shared memory: more than a launch gets without opt-in")
    return types


def ptxas_resources(ptx: str) -> dict:
    """What the GPU assembler gives a compiled kernel per thread: registers, spill bytes (stores, loads),
    from `ptxas -v` on its PTX for the PTX's own target (Triton's bundled ptxas, no GPU). A kernel that
    spills, or whose registers leave one program per SM, runs far below what its shape allows."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    target = re.search(r"\.target\s+(sm_\w+)", ptx).group(1)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        run = subprocess.run([get_ptxas(int(re.sub(r"\D", "", target))).path, "-v", f"-arch={target}", f.name,
                              "-o", "/dev/null"], capture_output=True, text=True, check=True)
    number = lambda pattern: int(re.search(pattern, run.stderr).group(1))  # noqa: E731
    return {"target": target, "registers": number(r"Used (\d+) registers"),
            "spill_stores": number(r"(\d+) bytes spill stores"), "spill_loads": number(r"(\d+) bytes spill loads")}


def describe(kernel) -> dict:
    """What `check_abi` and the plugin read from a compiled kernel."""
    meta = kernel.metadata
    return {"name": meta.name, "ptx": kernel.asm["ptx"], "cubin_bytes": len(kernel.asm.get("cubin", b"")),
            "shared": meta.shared, "num_warps": meta.num_warps,
            "scratch": {h: getattr(meta, h, 0) for h in HIDDEN}}


def plugin_ptx(described: dict, name: str) -> str:
    """The compiled kernel's PTX as the TensorRT plugin ships it: the entry renamed to `name` (TensorRT
    keys loaded kernels by name, so every dtype/shape variant gets its own), and Triton's hidden scratch
    parameters dropped from the entry, so it takes exactly the ABI's parameters whatever TensorRT does
    with missing ones. Refuses a kernel that uses scratch, or whose body reads a dropped parameter."""
    import re

    old, ptx = described["name"], described["ptx"]
    types = check_abi(ptx, old, described["shared"], described["scratch"])
    for i in range(len(ABI), len(types)):
        if len(re.findall(rf"\b{old}_param_{i}\b", ptx)) != 1:  # its declaration alone
            raise ValueError(f"the kernel body reads hidden parameter {i}: it cannot be dropped")
    head, params, tail = re.match(r"(.*?\.entry\s+\w+\s*\()([^)]*)(\).*)", ptx, re.S).groups()
    kept = ",".join(params.split(",")[: len(ABI)]).rstrip() + "\n"
    return re.sub(rf"\b{old}\b", name, head + kept + tail)
