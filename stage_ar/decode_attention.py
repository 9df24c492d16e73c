"""Split-KV decode attention for the batched decoder (CUDA, Triton), with the KV-cache write fused in.

One new query position per row (decode), grouped-query attention over a per-slot KV cache laid out
``(slots, kv_heads, capacity, head_dim)`` (`stage_ar.kv_pool.KVPool`, one layer). The
flash-decoding scheme (Dao et al., "Flash-Decoding for long-context inference", 2023): the key
range is cut into fixed splits of `SPLIT` positions; one program per (row, KV head, split) walks
its split in tiles of `BLOCK_N` keys with an online softmax (max ``m``, sum ``l``, ``P @ V``
accumulated in float32; the KV head's query heads, the GQA group, are the M rows of one
`tl.dot`); a second kernel, one program per (row, query head), combines the splits with the
usual rescaling ``exp(m_i - max_j m_j)``.

Why this instead of the two batched GEMMs + softmax of `stage_ar.attention.GEMMDecodeAttention`: at batch 1
those are three launches per layer over the whole length bucket plus two ``index_put`` launches
for the KV write (≈ 0.6 ms per step on the H200, `docs/PERFORMANCE.md`); tiles past a row's
position are skipped here, and the tile holding the new position writes the new key/value into
the cache itself (replacing the ``index_put`` launches) while using them from registers.

Batch invariance by construction: a row's arithmetic (its splits and tiles, their shapes and order,
the combine's reduction over a fixed number of split slots) depends only on its own position range
and the pool capacity, never on the batch size or the length bucket (splits beyond the row's
position contribute an exact ``+0``), so a request decodes to the same bits alone or in any batch.

Numerics: scores and softmax statistics in float32 (not rounded to the model dtype between the two
GEMMs as the eager path is), probabilities cast to the value dtype for ``P @ V`` (float32
accumulation), output normalised in float32 and cast to the query dtype.

`window_attention` is the same scheme for ``T`` query positions per row (a Jacobi verification
window, `stage_ar.jacobi`), causal inside the window, the window's KV write fused the same way; its
programs take up to 64 (window position, query head) rows of one KV head per ``tl.dot``.

Triton is optional: `available()` says whether this path can run (CUDA tensors and an importable
``triton``); CPU runs keep the eager path. ``TRITON_INTERPRET=1`` runs the kernels on CPU tensors
(the CPU test session turns it on, `tests/conftest.py`).
"""

from __future__ import annotations


import torch

from stage_ar.fp8 import FP8_MAX
from stage_ar.fp8_activations import DELAYED_MARGIN, MIN_ROW_SCALE, DelayedRows
from stage_ar.launch_overlap import INTERPRETED, launch_options, pdl_flag  # noqa: F401 - INTERPRETED re-exported

try:  # triton ships with CUDA builds of torch; CPU-only installs do not have it
    import triton
    import triton.language as tl

    from stage_ar.fp8_activations import delayed_row_scale, inverse_scale, quantize_values
    from stage_ar.launch_overlap import wait_for_predecessor
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None

#: Key positions per tile (one ``tl.dot``) and per split (one program's share of a row's keys; a
#: multiple of `BLOCK_N`, `tiles_per_split`). The split sets a row's reduction order (its bits), so it
#: is a rule, not a timing pick. 64 since 2026-12-06 (was 128): on the H100, W8A8 batch 1 in one
#: process (`benchmarks/ar_inprocess_ab.py OUT 1 attn`), ms per step at image start / mid-image: 128
#: 3.075 / 3.141, 64 **3.005 / 3.076**, 256 3.100 / 3.250, 128 again 3.082 / 3.137: at short lengths
#: each program walks half the tiles (a latency-bound chain), mid-image twice the programs fill a wave.
#: The H200 agrees (2026-12-06, the same command, image start): W8A8 64 **2.364**, 128 2.427, 64 over
#: 32-key tiles 2.395, 32 over 32 2.386; bf16 64 **3.716**, 128 3.784.
BLOCK_N = 64
SPLIT = 64


def tiles_per_split() -> int:
    """`SPLIT` / `BLOCK_N`, the tiles one split program walks.

    Raises:
        ValueError: `SPLIT` is not a positive multiple of `BLOCK_N`, or `BLOCK_N` is not a power of
            two of at least 16 (``tl.dot``'s smallest K): the split kernels would walk no tile, or
            leave keys out, and the combine would read partials nobody wrote.
    """
    if BLOCK_N < 16 or BLOCK_N & (BLOCK_N - 1) or SPLIT < BLOCK_N or SPLIT % BLOCK_N:
        raise ValueError(f"decode_attention.SPLIT ({SPLIT}) must be a positive multiple of BLOCK_N ({BLOCK_N}), "
                         "a power of two >= 16")
    return SPLIT // BLOCK_N


#: Load what no kernel of the current decode step writes before the PDL wait (each row's key range
#: and live flag, the split's first tile of cached keys and values), so those loads overlap the qkv
#: GEMV's stream instead of starting the attention's dependent chain after it. Why that is safe under
#: every `stage_ar.launch_overlap` mode: positions, key starts and live flags are written before a step
#: starts (the host's copies when a sequence is admitted or leaves, and the previous step's own
#: ``cache_pos += 1`` after its sampler), and cached positions ``< pos`` by earlier steps or the
#: prefill; and no kernel of a step starts before the previous step has completed (a CUDA graph's
#: launch waits for the stream's earlier work; eagerly, a step begins and ends with kernels launched
#: without PDL). This step's key and value come from registers (`_kv_tile` never loads ``pos``), so no
#: early load can see this step's KV write. The same values, so the same bits. Read at each launch.
#: On since 2026-12-06: on the H200, one process (`benchmarks/ar_inprocess_ab.py OUT 1 kvload`, batch
#: 1, ms per step off / on / off / on, image start): W8A8 2.403 / **2.362** / 2.401 / **2.361**
#: (mid-image 2.474 / 2.451 / 2.474 / 2.450), bf16 3.715 / **3.680** / 3.719 / **3.681** (mid-image
#: 3.779 / 3.754 / 3.785 / 3.753).
EARLY_LOADS = True


#: Splits the combine merges per step of its loop (`_merge_splits`' ``CHUNK``): 0, one tile of all
#: the pool's split slots (``MAX_SPLITS``: 256 for the served 12,288-position pool at 64 keys per
#: split, a ``(256, 128)`` float32 tile per program), or a power of two, that many at a time over the
#: row's own splits only. It sets the order in which a row's splits are summed (its bits), so it is a
#: rule like `SPLIT`; 0 keeps the bits every measurement so far was made with. Opt-in until measured
#: (`benchmarks/ar_inprocess_ab.py OUT 1 merge`); read at each launch.
MERGE_CHUNK = 0


def merge_chunk(max_splits: int) -> int:
    """`MERGE_CHUNK` for a combine over ``max_splits`` split slots: 0, or ``min(MERGE_CHUNK, max_splits)``.

    Raises:
        ValueError: `MERGE_CHUNK` is neither 0 nor a power of two (``tl.arange`` needs one).
    """
    if MERGE_CHUNK < 0 or MERGE_CHUNK & (MERGE_CHUNK - 1):
        raise ValueError(f"decode_attention.MERGE_CHUNK must be 0 or a power of two, got {MERGE_CHUNK}")
    return min(MERGE_CHUNK, max_splits)


def available(device: torch.device) -> bool:
    """True when the fused kernel can run on ``device``: CUDA with triton, or any device under the
    interpreter."""
    return triton is not None and (device.type == "cuda" or INTERPRETED)


if triton is not None:

    @triton.jit
    def _row_live(live_ptr, row, LIVE: tl.constexpr):
        """Whether ``row`` is computed: its flag at ``live_ptr`` under ``LIVE``, else always (a scalar
        tensor either way, so no Python bool is mixed into a runtime condition)."""
        alive = row >= 0
        if LIVE:
            alive = tl.load(live_ptr + row) != 0
        return alive

    @triton.jit
    def _row_range(pos_ptr, start_ptr, live_ptr, row, LIVE: tl.constexpr):
        """Row ``row``'s new position, first key position and live flag (`_row_live`): written before a
        step starts, so loadable before the PDL wait (`EARLY_LOADS`)."""
        return tl.load(pos_ptr + row), tl.load(start_ptr + row), _row_live(live_ptr, row, LIVE)

    @triton.jit
    def _kv_tile(k_cache_ptr, v_cache_ptr, cache_off, lo, pos, start, alive, offs_b, offs_d, stride_cn):
        """The cached keys and values of key positions ``lo + offs_b`` that lie in ``[start, pos)``
        (zeros elsewhere, and for an idle row: no load), ``(BLOCK, HEAD_DIM)`` each. Position ``pos``
        itself is this step's and comes from registers, so no load depends on this step's writes."""
        offs_n = lo + offs_b
        valid = (offs_n >= start) & (offs_n < tl.where(alive, pos, start))  # (a scalar flag in a block mask
        # trips Triton's interpreter: an empty range instead)
        tile = cache_off + offs_n[:, None] * stride_cn + offs_d[None, :]
        k = tl.load(k_cache_ptr + tile, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + tile, mask=valid[:, None], other=0.0)
        return k, v

    @triton.jit
    def _attend_tile(q, k, v, k_new, v_new, lo, pos, start, offs_b, m, l_sum, acc, scale):
        """One tile's keys ``lo + offs_b`` (``k``, ``v`` from `_kv_tile`; the new position's from
        ``k_new`` / ``v_new``) folded into the online softmax ``(m, l_sum, acc)``."""
        offs_n = lo + offs_b
        is_new = offs_n == pos
        attended = ((offs_n >= start) & (offs_n < pos)) | is_new
        k = tl.where(is_new[:, None], k_new[None, :], k)
        v = tl.where(is_new[:, None], v_new[None, :], v)
        s = tl.dot(q, tl.trans(k)) * scale  # (GROUP_PAD, BLOCK) float32
        s = tl.where(attended[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_sum, acc

    @triton.jit
    def _split_kernel(
        q_ptr, k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, start_ptr, live_ptr,
        part_acc_ptr, part_ml_ptr,
        stride_qb, stride_qh,
        stride_nb, stride_nh, stride_vnb, stride_vnh,
        stride_cs, stride_ch, stride_cn,
        n_splits, scale,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
        TILES: tl.constexpr, PDL: tl.constexpr = False, LIVE: tl.constexpr = False,
        EARLY_LOADS: tl.constexpr = False,
    ):
        """Program (row, KV head, split): the split's keys attended (online softmax), the partials
        stored; the tile holding ``pos`` writes the new key/value. ``EARLY_LOADS`` (the module's
        `EARLY_LOADS`): the row's range and the split's first cached tile are loaded before the PDL wait."""
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_b = tl.arange(0, BLOCK)
        cache_off = row * stride_cs + kvh * stride_ch
        first_lo = split * TILES * BLOCK
        if EARLY_LOADS:  # nothing this step writes: the range and the old keys/values (see `EARLY_LOADS`)
            pos, start, alive = _row_range(pos_ptr, start_ptr, live_ptr, row, LIVE)
            k_first, v_first = _kv_tile(k_cache_ptr, v_cache_ptr, cache_off, first_lo, pos, start, alive, offs_b,
                                        offs_d, stride_cn)
        wait_for_predecessor(PDL)  # `stage_ar.launch_overlap`
        if not EARLY_LOADS:  # an idle row (not alive): no KV write, no work (its combine writes zeros)
            pos, start, alive = _row_range(pos_ptr, start_ptr, live_ptr, row, LIVE)
        # a split outside the row's keys [start, pos] does nothing: no load, no store (the merge skips it)
        if alive & (split >= start // (TILES * BLOCK)) & (split <= pos // (TILES * BLOCK)):
            offs_g = tl.arange(0, GROUP_PAD)
            k_new = tl.load(k_new_ptr + row * stride_nb + kvh * stride_nh + offs_d)
            v_new = tl.load(v_new_ptr + row * stride_vnb + kvh * stride_vnh + offs_d)
            q = tl.load(q_ptr + row * stride_qb + (kvh * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :],
                        mask=(offs_g < GROUP)[:, None], other=0.0)
            m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
            l_sum = tl.zeros((GROUP_PAD,), tl.float32)
            acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
            for t in range(TILES):  # fixed tile order; tiles outside [start, pos] are skipped
                lo = first_lo + t * BLOCK
                if (lo <= pos) & (lo + BLOCK > start):
                    if (pos >= lo) & (pos < lo + BLOCK):  # the KV-cache write of this step, fused
                        tl.store(k_cache_ptr + cache_off + pos * stride_cn + offs_d, k_new)
                        tl.store(v_cache_ptr + cache_off + pos * stride_cn + offs_d, v_new)
                    if EARLY_LOADS:
                        if t == 0:
                            k, v = k_first, v_first
                        else:
                            k, v = _kv_tile(k_cache_ptr, v_cache_ptr, cache_off, lo, pos, start, alive, offs_b,
                                            offs_d, stride_cn)
                    else:
                        k, v = _kv_tile(k_cache_ptr, v_cache_ptr, cache_off, lo, pos, start, alive, offs_b, offs_d,
                                        stride_cn)
                    m, l_sum, acc = _attend_tile(q, k, v, k_new, v_new, lo, pos, start, offs_b, m, l_sum, acc, scale)
            part = (row * tl.num_programs(1) + kvh) * n_splits + split
            tl.store(part_ml_ptr + part * 2 * GROUP_PAD + offs_g, m)
            tl.store(part_ml_ptr + part * 2 * GROUP_PAD + GROUP_PAD + offs_g, l_sum)
            tl.store(part_acc_ptr + part * GROUP_PAD * HEAD_DIM + offs_g[:, None] * HEAD_DIM + offs_d[None, :], acc)

    @triton.jit
    def _merge_splits(part_acc_ptr, part_ml_ptr, n_splits, q_rows, q, first_split, last_split,
                      HEAD_DIM: tl.constexpr, MAX_SPLITS: tl.constexpr, CHUNK: tl.constexpr = 0):
        """Query row ``q`` of this (row, KV head) program: the split partials ``(max, sum, acc)``
        (``q_rows`` query rows per split) merged by log-sum-exp; ``(HEAD_DIM,)`` float32. The one
        merge of both kernels' combine passes.

        Only splits ``first_split ..= last_split`` (those overlapping the row's key range) are read:
        the split kernels store nothing for the others, which hold no key of the row, and the masked
        loads give exactly what such a split would have stored (max ``-inf``, sum 0, acc 0), so the
        reduction over the fixed ``MAX_SPLITS`` lanes sees the same values as if every split had been
        written. Traffic follows the row's position, not the pool capacity.

        ``CHUNK`` (`MERGE_CHUNK`): 0 sums the weighted partial outputs as one ``(MAX_SPLITS, HEAD_DIM)``
        tile; otherwise ``CHUNK`` splits at a time, in split order, over the chunks that overlap the
        row's splits only (the others would add exact zeros), so the tile held is ``(CHUNK,
        HEAD_DIM)`` and the work follows the row's position, not the pool. The maximum and the
        normaliser are one ``MAX_SPLITS``-lane reduction either way; ``CHUNK == MAX_SPLITS`` gives the
        bits of 0."""
        offs_s = tl.arange(0, MAX_SPLITS)
        offs_d = tl.arange(0, HEAD_DIM)
        have = (offs_s < n_splits) & (offs_s >= first_split) & (offs_s <= last_split)
        base = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * n_splits
        parts = base + offs_s
        m = tl.load(part_ml_ptr + parts * 2 * q_rows + q, mask=have, other=float("-inf"))
        l_sum = tl.load(part_ml_ptr + parts * 2 * q_rows + q_rows + q, mask=have, other=0.0)
        m_max = tl.max(m, 0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
        total = tl.sum(w * l_sum, 0)
        if CHUNK == 0:
            part = tl.load(part_acc_ptr + (parts * q_rows + q)[:, None] * HEAD_DIM + offs_d[None, :],
                           mask=have[:, None], other=0.0)
            acc = tl.sum(w[:, None] * part, 0)
        else:
            offs_c = tl.arange(0, CHUNK)
            acc = tl.zeros((HEAD_DIM,), tl.float32)
            for c0 in range(first_split // CHUNK * CHUNK, last_split + 1, CHUNK):
                lanes = c0 + offs_c
                have_c = (lanes < n_splits) & (lanes >= first_split) & (lanes <= last_split)
                m_c = tl.load(part_ml_ptr + (base + lanes) * 2 * q_rows + q, mask=have_c, other=float("-inf"))
                w_c = tl.where(m_c == float("-inf"), 0.0, tl.exp(m_c - m_max))
                part = tl.load(part_acc_ptr + ((base + lanes) * q_rows + q)[:, None] * HEAD_DIM + offs_d[None, :],
                               mask=have_c[:, None], other=0.0)
                acc += tl.sum(w_c[:, None] * part, 0)
        return acc / tl.where(total == 0.0, 1.0, total)

    @triton.jit
    def _combine_kernel(
        part_acc_ptr, part_ml_ptr, out_ptr, pos_ptr, start_ptr, live_ptr, amax_ptr, n_splits, stride_ob,
        codes_ptr, min_scale,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, MAX_SPLITS: tl.constexpr,
        SPLIT_KEYS: tl.constexpr, PDL: tl.constexpr = False, LIVE: tl.constexpr = False,
        AMAX_OUT: tl.constexpr = False, EARLY_LOADS: tl.constexpr = False, CHUNK: tl.constexpr = 0,
        QUANT_OUT: tl.constexpr = False, FP8_MAX_: tl.constexpr = 448.0, MARGIN: tl.constexpr = 4.0,
    ):
        """Query head ``kvh * GROUP + g`` of row ``program_id(0)``: its splits merged and stored.
        ``AMAX_OUT``: the stored values' largest magnitude max-ed into ``amax_ptr[row]`` (int32 float
        bits; exact in any order), the row's amax for the W8A8 o_proj (`stage_ar.fp8_activations.RowsWithAmax`).
        ``EARLY_LOADS`` (the module's `EARLY_LOADS`): the row's range is loaded before the PDL wait.
        ``QUANT_OUT`` (delayed activation scales, `stage_ar.fp8_activations.DelayedOut`, opt-in): the stored
        values also as E4M3 codes at ``codes_ptr`` (same layout), quantized with ``row_scale(MARGIN * a)``, ``a``
        the row's amax one step earlier at ``amax_ptr[row]``, and this step's amax max-ed into
        ``amax_ptr[16 + row]``."""
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        g = tl.program_id(2)
        if EARLY_LOADS:
            pos, start, alive = _row_range(pos_ptr, start_ptr, live_ptr, row, LIVE)
        wait_for_predecessor(PDL)  # `stage_ar.launch_overlap`
        if not EARLY_LOADS:
            pos, start, alive = _row_range(pos_ptr, start_ptr, live_ptr, row, LIVE)
        first = start // SPLIT_KEYS
        last = pos // SPLIT_KEYS
        offs_d = tl.arange(0, HEAD_DIM)
        off = row * stride_ob + (kvh * GROUP + g) * HEAD_DIM + offs_d
        at = out_ptr + off
        if alive:
            out = _merge_splits(part_acc_ptr, part_ml_ptr, n_splits, GROUP_PAD, g, first, last, HEAD_DIM, MAX_SPLITS,
                                CHUNK)
            stored = out.to(out_ptr.dtype.element_ty)
            tl.store(at, stored)
            if AMAX_OUT:
                tl.atomic_max(amax_ptr + row, tl.max(tl.abs(stored.to(tl.float32)), 0).to(tl.int32, bitcast=True))
            if QUANT_OUT:
                inv = inverse_scale(delayed_row_scale(amax_ptr, row, True, min_scale, FP8_MAX_, MARGIN))
                tl.store(codes_ptr + off, quantize_values(stored.to(tl.float32), inv, FP8_MAX_))
                tl.atomic_max(amax_ptr + 16 + row, tl.max(tl.abs(stored.to(tl.float32)), 0).to(tl.int32, bitcast=True))
        else:
            tl.store(at, tl.zeros((HEAD_DIM,), out_ptr.dtype.element_ty))
            if QUANT_OUT:
                tl.store(codes_ptr + off, tl.zeros((HEAD_DIM,), tl.float8e4nv))


    @triton.jit
    def _window_split_kernel(
        q_ptr, k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, pos_ptr, start_ptr,
        part_acc_ptr, part_ml_ptr,
        stride_qr, stride_qt, stride_qh,
        stride_nr, stride_nt, stride_nh, stride_vnr, stride_vnt, stride_vnh,
        stride_cs, stride_ch, stride_cn,
        n_splits, scale, window, q_blocks,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
        TILES: tl.constexpr,
    ):
        # query row m of the (row, KV head) = window position m // GROUP, query head m % GROUP; the
        # window length is a runtime value (one compiled kernel per BLOCK_M, not per window length)
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2) // q_blocks
        qb = tl.program_id(2) % q_blocks
        slot = tl.load(slot_ptr + row)
        pos = tl.load(pos_ptr + row)
        start = tl.load(start_ptr + row)
        # a split outside the window's keys [start, pos + window - 1] does nothing (the merge skips it)
        if (split >= start // (TILES * BLOCK)) & (split <= (pos + window - 1) // (TILES * BLOCK)):
            offs_d = tl.arange(0, HEAD_DIM)
            offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_b = tl.arange(0, BLOCK)
            real = offs_m < window * GROUP
            t_q = tl.minimum(offs_m // GROUP, window - 1)
            q_pos = pos + t_q  # each query row's own position (causal inside the window)
            q_hi = pos + tl.minimum((qb * BLOCK_M + BLOCK_M - 1) // GROUP, window - 1)
            cache_off = slot * stride_cs + kvh * stride_ch
            q = tl.load(q_ptr + row * stride_qr + t_q[:, None] * stride_qt
                        + (kvh * GROUP + offs_m % GROUP)[:, None] * stride_qh + offs_d[None, :],
                        mask=real[:, None], other=0.0)
            m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            l_sum = tl.zeros((BLOCK_M,), tl.float32)
            acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
            for t in range(TILES):  # fixed tile order; tiles outside [start, q_hi] are skipped
                lo = (split * TILES + t) * BLOCK
                if (lo <= q_hi) & (lo + BLOCK > start):
                    offs_n = lo + offs_b
                    in_win = (offs_n >= pos) & (offs_n < pos + window)  # the window's keys, from k_new
                    w_off = (offs_n - pos)[:, None]
                    k_w = tl.load(k_new_ptr + row * stride_nr + w_off * stride_nt + kvh * stride_nh + offs_d[None, :],
                                  mask=in_win[:, None], other=0.0)
                    v_w = tl.load(v_new_ptr + row * stride_vnr + w_off * stride_vnt + kvh * stride_vnh
                                  + offs_d[None, :], mask=in_win[:, None], other=0.0)
                    tile = cache_off + offs_n[:, None] * stride_cn + offs_d[None, :]
                    if qb == q_blocks - 1:  # the KV-cache write of the window, fused (one program per key)
                        tl.store(k_cache_ptr + tile, k_w, mask=in_win[:, None])
                        tl.store(v_cache_ptr + tile, v_w, mask=in_win[:, None])
                    cached = (offs_n >= start) & (offs_n < pos)
                    k = tl.load(k_cache_ptr + tile, mask=cached[:, None], other=0.0)
                    k = tl.where(in_win[:, None], k_w, k)
                    s = tl.dot(q, tl.trans(k)) * scale  # (BLOCK_M, BLOCK) float32
                    valid = (offs_n[None, :] >= start) & (offs_n[None, :] <= q_pos[:, None])
                    s = tl.where(valid, s, float("-inf"))
                    m_new = tl.maximum(m, tl.max(s, 1))
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query with no key here yet
                    alpha = tl.exp(m - m_safe)
                    p = tl.exp(s - m_safe[:, None])
                    v = tl.load(v_cache_ptr + tile, mask=cached[:, None], other=0.0)
                    v = tl.where(in_win[:, None], v_w, v)
                    l_sum = l_sum * alpha + tl.sum(p, 1)
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                    m = m_new
            m_total = q_blocks * BLOCK_M
            part = (row * tl.num_programs(1) + kvh) * n_splits + split
            tl.store(part_ml_ptr + part * 2 * m_total + offs_m, m)
            tl.store(part_ml_ptr + part * 2 * m_total + m_total + offs_m, l_sum)
            tl.store(part_acc_ptr + part * m_total * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :], acc)

    @triton.jit
    def _window_combine_kernel(
        part_acc_ptr, part_ml_ptr, out_ptr, pos_ptr, start_ptr, n_splits, m_total, window, stride_or, stride_ot,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, MAX_SPLITS: tl.constexpr, SPLIT_KEYS: tl.constexpr,
        CHUNK: tl.constexpr = 0,
    ):
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        mq = tl.program_id(2)  # query row: window position mq // GROUP, query head mq % GROUP
        first = tl.load(start_ptr + row) // SPLIT_KEYS
        last = (tl.load(pos_ptr + row) + window - 1) // SPLIT_KEYS  # the split kernels' stored range
        out = _merge_splits(part_acc_ptr, part_ml_ptr, n_splits, m_total, mq, first, last, HEAD_DIM, MAX_SPLITS, CHUNK)
        offs_d = tl.arange(0, HEAD_DIM)
        head = kvh * GROUP + mq % GROUP
        tl.store(out_ptr + row * stride_or + (mq // GROUP) * stride_ot + head * HEAD_DIM + offs_d,
                 out.to(out_ptr.dtype.element_ty))


def split_partials(rows: int, kv_heads: int, n_splits: int, q_rows: int, head_dim: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernels' float32 workspace, uninitialised: partial outputs ``(rows, kv_heads,
    n_splits, q_rows, head_dim)`` and softmax statistics ``(rows, kv_heads, n_splits, 2, q_rows)``
    (max, then sum). Only the splits overlapping a row's key range are written and read."""
    part_acc = torch.empty((rows, kv_heads, n_splits, q_rows, head_dim), device=device, dtype=torch.float32)
    part_ml = torch.empty((rows, kv_heads, n_splits, 2, q_rows), device=device, dtype=torch.float32)
    return part_acc, part_ml


def _check_layout(q, k_new, v_new, k_cache, v_cache, length: int) -> None:  # noqa: ANN001 - tensors
    """`decode_attention`'s shape and stride rules (its docstring); raises ValueError naming them."""
    b, heads, head_dim = q.shape
    kv_heads = k_new.shape[1]
    if heads % kv_heads or k_cache.shape[1] != kv_heads or k_cache.shape[-1] != head_dim:
        raise ValueError(f"q {tuple(q.shape)}, k_new {tuple(k_new.shape)}, cache {tuple(k_cache.shape)} do not match")
    if length > k_cache.shape[2] or k_cache.shape[0] < b:
        raise ValueError(f"length {length} / batch {b} beyond the cache {tuple(k_cache.shape)}")
    for t in (q, k_new, v_new, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("decode_attention needs the head dimension contiguous")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("key and value caches must share one layout")


def decode_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    key_start: torch.Tensor,
    length: int,
    scale: float,
    live: torch.Tensor | None = None,
    amax_out: torch.Tensor | None = None,
    rows: int | None = None,
    delayed_out=None,
):
    """Write this step's keys/values into the cache and attend over each row's key range.

    Row ``i`` uses cache slot ``i`` and attends over key positions ``[key_start[i], pos[i]]``
    (inclusive; ``pos[i]`` is the new position, whose key/value are ``k_new[i]``/``v_new[i]``).

    Args:
        q: ``(b, heads, head_dim)`` queries after RoPE (bf16/fp16/fp32; last dim contiguous).
        k_new, v_new: ``(b, kv_heads, head_dim)`` this step's key (after RoPE) and value.
        k_cache, v_cache: ``(slots >= b, kv_heads, capacity, head_dim)`` one layer of the pool;
            position ``pos[i]`` of slot ``i`` is overwritten with ``k_new[i]``/``v_new[i]``.
        pos, key_start: ``(b,)`` int64 on the device; ``key_start[i] <= pos[i] < length``.
        length: key positions ``[0, length)`` that any row may attend to (the length bucket; only
            sizes the grid: tiles past a row's ``pos`` are skipped).
        scale: softmax scale (``head_dim ** -0.5``).
        live: ``(b,)`` bool on the device, read when the kernels run, or None (every row): a row
            whose flag is False (an idle slot of a padded step) writes no key/value, reads nothing
            and gets zeros; the other rows' bits are unchanged.
        amax_out: ``(16,)`` int32 (`stage_ar.fp8_activations.amax_buffers`' ``amax``, ``b <= 16``) or
            None: each output row's largest magnitude is max-ed into it (float32 bits), for a W8A8
            o_proj that quantizes the rows in its prologue (`stage_ar.fp8_activations.RowsWithAmax`).
        rows: launch programs for rows ``[0, rows)`` only (``1 <= rows <= b``; None: all ``b``), the
            served step's bucket of live rows (`stage_ar.runner`'s ``trim_gemv_rows``): a row past it
            reads and writes no key/value whatever its ``live`` flag, and its output is left as
            allocated (unspecified). A computed row's bits do not depend on ``rows`` (every program is
            one row's). Idle rows cost programs even when they exit at once: 16 rows x 4 KV heads x
            64 splits per layer at 4,096 keys.
        delayed_out: a `stage_ar.fp8_activations.DelayedOut` (no norm weight; ``b <= 16``, not with
            ``amax_out``) or None: the output rows also as E4M3 codes for a W8A8 o_proj, quantized with
            delayed scales (opt-in experiment of issue 17).

    Returns:
        ``(b, heads * head_dim)`` attention output in ``q``'s dtype; with ``delayed_out``, ``(that,
        DelayedRows)``.

    Raises:
        RuntimeError: triton is not installed (check `available` first).
        ValueError: shapes that do not fit the layout above.
    """
    if triton is None:
        raise RuntimeError("decode_attention needs triton (a CUDA build of torch ships it)")
    _check_layout(q, k_new, v_new, k_cache, v_cache, length)
    b, heads, head_dim = q.shape
    if live is not None and (live.shape != (b,) or live.dtype != torch.bool or live.device != q.device):
        raise ValueError(f"live must be ({b},) bool on {q.device}, "
                         f"got {tuple(live.shape)} {live.dtype} on {live.device}")
    if amax_out is not None and (amax_out.shape != (16,) or amax_out.dtype != torch.int32
                                 or amax_out.device != q.device or b > 16):
        raise ValueError(f"amax_out must be (16,) int32 on {q.device} for at most 16 rows, got "
                         f"{tuple(amax_out.shape)} {amax_out.dtype} on {amax_out.device} for {b} rows")
    if rows is not None and not 1 <= rows <= b:
        raise ValueError(f"rows must be None or 1..{b} (the rows to compute), got {rows}")
    if delayed_out is not None and (amax_out is not None or delayed_out.norm_weight is not None or b > 16):
        raise ValueError("delayed_out takes at most 16 rows, no norm weight, and not amax_out")
    computed = b if rows is None else rows
    kv_heads = k_new.shape[1]
    group = heads // kv_heads
    group_pad = max(16, triton.next_power_of_2(group))  # tl.dot needs M >= 16
    n_splits = triton.cdiv(length, SPLIT)
    # The combine reads a fixed number of split slots (from the cache capacity, not ``length``), so
    # its reduction tree, like everything else a row computes, is the same for every length bucket.
    max_splits = triton.next_power_of_2(triton.cdiv(k_cache.shape[2], SPLIT))
    part_acc, part_ml = split_partials(b, kv_heads, n_splits, group_pad, head_dim, q.device)
    out = torch.empty((b, heads * head_dim), device=q.device, dtype=q.dtype)
    codes, state = None, None
    if delayed_out is not None:
        from stage_ar.fp8 import FP8_DTYPE

        codes = torch.empty((b, heads * head_dim), device=q.device, dtype=FP8_DTYPE)
        state = delayed_out.state[32 * delayed_out.point:]
    pdl = pdl_flag(q.device)
    _split_kernel[(computed, kv_heads, n_splits)](
        q, k_new, v_new, k_cache, v_cache, pos, key_start, pos if live is None else live, part_acc, part_ml,
        q.stride(0), q.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        n_splits, float(scale),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK=BLOCK_N, TILES=tiles_per_split(),
        PDL=pdl, LIVE=live is not None, EARLY_LOADS=EARLY_LOADS, **launch_options(pdl),
    )
    _combine_kernel[(computed, kv_heads, group)](
        part_acc, part_ml, out, pos, key_start, pos if live is None else live,
        amax_out if amax_out is not None else state if state is not None else pos, n_splits, out.stride(0),
        codes if codes is not None else out, MIN_ROW_SCALE,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, MAX_SPLITS=max_splits, SPLIT_KEYS=SPLIT,
        CHUNK=merge_chunk(max_splits),
        PDL=pdl, LIVE=live is not None, AMAX_OUT=amax_out is not None, EARLY_LOADS=EARLY_LOADS,
        QUANT_OUT=codes is not None, FP8_MAX_=FP8_MAX, MARGIN=DELAYED_MARGIN, **launch_options(pdl),
    )
    if codes is None:
        return out
    return out, DelayedRows(codes, delayed_out.state, delayed_out.point, None, 1e-6, q.dtype, out)


#: Query rows (window positions x query heads of one KV head) per split program of `window_attention`.
WINDOW_BLOCK_M = 64


def window_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    pos: torch.Tensor,
    key_start: torch.Tensor,
    length: int,
    scale: float,
) -> torch.Tensor:
    """`decode_attention` for ``T`` query positions per row (a Jacobi window), causal inside the window.

    Row ``i`` uses cache slot ``slots[i]``; its ``T`` new keys/values are written at positions
    ``pos[i] .. pos[i] + T - 1`` and its query ``t`` attends over key positions
    ``[key_start[i], pos[i] + t]``. The same split-KV scheme, tiles and float32 softmax statistics as
    `decode_attention`; the M rows of a program's ``tl.dot`` are (window position, query head) pairs
    of one KV head, at most `WINDOW_BLOCK_M` per program. ``T`` is a runtime argument of the kernels:
    they compile once per tile height (16, 32 or 64 rows), not once per window length. With ``T = 1`` and ``slots[i] = i`` the
    output equals `decode_attention`'s bit for bit (same dot shapes, same reduction order); a row's
    bits depend only on its own ``pos``, ``key_start``, ``T`` and the cache capacity, never on the
    other rows or ``length`` (batch invariance, as `decode_attention`).

    Args:
        q: ``(R, T, heads, head_dim)`` queries after RoPE (last dim contiguous).
        k_new, v_new: ``(R, T, kv_heads, head_dim)`` the window's keys (after RoPE) and values.
        k_cache, v_cache: ``(slots, kv_heads, capacity, head_dim)`` one layer of the pool.
        slots, pos, key_start: ``(R,)`` int64 on the device; ``key_start[i] <= pos[i]`` and
            ``pos[i] + T <= length``.
        length: key positions ``[0, length)`` any row may read (sizes the grid only).
        scale: softmax scale.

    Returns:
        ``(R, T, heads * head_dim)`` in ``q``'s dtype.

    Raises:
        RuntimeError: triton is not installed.
        ValueError: shapes that do not fit the layout above.
    """
    if triton is None:
        raise RuntimeError("window_attention needs triton (a CUDA build of torch ships it)")
    r, window, heads, head_dim = q.shape
    if tuple(k_new.shape[:2]) != (r, window) or k_new.shape != v_new.shape:
        raise ValueError(f"q {tuple(q.shape)}, k_new {tuple(k_new.shape)}, v_new {tuple(v_new.shape)} do not match")
    _check_layout(q[:, 0], k_new[:, 0], v_new[:, 0], k_cache, v_cache, length)
    if slots.shape != pos.shape or pos.shape != (r,):
        raise ValueError(f"slots {tuple(slots.shape)} / pos {tuple(pos.shape)} must be ({r},)")
    kv_heads = k_new.shape[2]
    group = heads // kv_heads
    rows = window * group
    block_m = max(16, min(WINDOW_BLOCK_M, triton.next_power_of_2(rows)))  # tl.dot needs M >= 16
    q_blocks = triton.cdiv(rows, block_m)
    n_splits = triton.cdiv(length, SPLIT)
    max_splits = triton.next_power_of_2(triton.cdiv(k_cache.shape[2], SPLIT))
    m_total = q_blocks * block_m
    part_acc, part_ml = split_partials(r, kv_heads, n_splits, m_total, head_dim, q.device)
    out = torch.empty((r, window, heads * head_dim), device=q.device, dtype=q.dtype)
    _window_split_kernel[(r, kv_heads, n_splits * q_blocks)](
        q, k_new, v_new, k_cache, v_cache, slots, pos, key_start, part_acc, part_ml,
        q.stride(0), q.stride(1), q.stride(2),
        k_new.stride(0), k_new.stride(1), k_new.stride(2), v_new.stride(0), v_new.stride(1), v_new.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        n_splits, float(scale), window, q_blocks,
        GROUP=group, BLOCK_M=block_m, HEAD_DIM=head_dim, BLOCK=BLOCK_N, TILES=tiles_per_split(),
    )
    _window_combine_kernel[(r, kv_heads, rows)](
        part_acc, part_ml, out, pos, key_start, n_splits, m_total, window, out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, MAX_SPLITS=max_splits, SPLIT_KEYS=SPLIT, CHUNK=merge_chunk(max_splits),
    )
    return out
