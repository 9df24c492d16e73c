"""`stage_ar.decode_attention` (split-KV decode attention, KV write fused) and the batched decoder
driving it. Without a GPU the kernels run in Triton's CPU interpreter (`tests/conftest.py` turns it
on); on the GPU machine the same tests run compiled (`benchmarks/ar_decode.py` runs them too).

The interpreter computes with numpy, which has no bfloat16 (its bf16 ``tl.dot`` is wrong), so the
cases here are float32 and float16; bf16 is checked on the GPU machine.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def da():
    import stage_ar.decode_attention as module

    if not module.available(torch.device(DEVICE)):
        pytest.skip("triton cannot run here (no CUDA, interpreter off)")
    return module


def reference(q, k_new, v_new, k_cache, v_cache, pos, start, scale):
    """Write the new key/value, then softmax attention over [start, pos] in float64."""
    q, k_new, v_new, k_cache, v_cache, pos, start = (t.cpu() for t in (q, k_new, v_new, k_cache, v_cache, pos, start))
    b, heads, d = q.shape
    kv_heads = k_new.shape[1]
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    out = torch.empty(b, heads * d, dtype=q.dtype)
    for i in range(b):
        k_cache[i, :, pos[i]] = k_new[i]
        v_cache[i, :, pos[i]] = v_new[i]
        keys = k_cache[i, :, start[i] : pos[i] + 1].double()
        values = v_cache[i, :, start[i] : pos[i] + 1].double()
        qg = q[i].double().view(kv_heads, heads // kv_heads, d)
        probs = torch.softmax(qg @ keys.transpose(-1, -2) * scale, dim=-1)
        out[i] = (probs @ values).reshape(-1).to(q.dtype)
    return out, k_cache, v_cache


def inputs(dtype, b=3, heads=28, kv_heads=4, d=128, capacity=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, d, generator=g).to(dtype)
    # k/v as views into one fused projection row block (the decoder passes strided views)
    qkv = torch.randn(b, 2 * kv_heads * d + 8, generator=g).to(dtype)
    k_new = qkv[:, : kv_heads * d].view(b, kv_heads, d)
    v_new = qkv[:, kv_heads * d : 2 * kv_heads * d].view(b, kv_heads, d)
    k_cache = torch.randn(b + 1, kv_heads, capacity, d, generator=g).to(dtype)
    v_cache = torch.randn(b + 1, kv_heads, capacity, d, generator=g).to(dtype)
    return tuple(t.to(DEVICE) for t in (q, k_new, v_new, k_cache, v_cache))


def ids(*values):
    return torch.tensor(values, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_reference_and_writes_the_cache(da, dtype):
    if dtype == torch.bfloat16 and da.INTERPRETED:
        pytest.skip("numpy (the interpreter) has no bfloat16")
    # float32 tl.dot runs in TF32 on the GPU
    tol = {torch.float32: 1e-5 if da.INTERPRETED else 5e-3, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    q, k_new, v_new, k_cache, v_cache = inputs(dtype)
    pos = ids(5, 130, 70)  # in block 0, block 2 (crossing blocks), block 1
    start = ids(0, 3, 64)  # row 2: its range starts at a block boundary
    want, want_k, want_v = reference(q, k_new, v_new, k_cache, v_cache, pos, start, 128**-0.5)
    got = da.decode_attention(q, k_new, v_new, k_cache, v_cache, pos, start, 192, 128**-0.5)
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(k_cache.cpu(), want_k) and torch.equal(v_cache.cpu(), want_v)  # exactly the new rows written


def test_batch_and_length_bucket_invariant(da):
    """A row's output bits do not depend on the other rows or on the length bucket."""
    q, k_new, v_new, k_cache, v_cache = inputs(torch.float16, b=4, seed=1)
    pos = ids(200, 17, 99, 64)
    start = ids(0, 0, 40, 0)
    batch = da.decode_attention(q, k_new, v_new, k_cache.clone(), v_cache.clone(), pos, start, 256, 0.1)
    for i in range(4):
        alone = da.decode_attention(q[i : i + 1], k_new[i : i + 1], v_new[i : i + 1], k_cache[i : i + 1].clone(),
                                    v_cache[i : i + 1].clone(), pos[i : i + 1], start[i : i + 1],
                                    int(pos[i]) + 1 if i else 256, 0.1)
        assert torch.equal(alone[0], batch[i]), f"row {i}"


def poisoned_partials(da, monkeypatch) -> list:
    """Make the split kernels' workspace NaN-filled (``torch.empty`` may hand back anything) and
    keep each one handed out: a merge that read an entry no split kernel wrote would turn NaN."""
    handed = []
    make = da.split_partials

    def poisoned(*args):
        parts = tuple(t.fill_(float("nan")) for t in make(*args))
        handed.append(parts)
        return parts

    monkeypatch.setattr(da, "split_partials", poisoned)
    return handed


def splits_of(da, first: torch.Tensor, last: torch.Tensor) -> tuple[set[int], ...]:
    """Each row's split indices covering its keys ``[first, last]`` at the module's split size
    (``da.SPLIT`` keys per split: the expectation follows the rule, whatever its value)."""
    return tuple(set(range(int(a) // da.SPLIT, int(b) // da.SPLIT + 1)) for a, b in zip(first, last))


def assert_only_used_splits_written(handed: list, used_by_row: tuple[set[int], ...]) -> None:
    """The one workspace in ``handed``: row ``i``'s splits in ``used_by_row[i]`` were written, every
    other split of the workspace still holds the poison."""
    (part_acc, part_ml), = handed
    for row, used in enumerate(used_by_row):
        for split in range(part_acc.shape[2]):
            untouched = bool(part_acc[row, :, split].isnan().all() and part_ml[row, :, split].isnan().all())
            assert untouched == (split not in used), f"row {row} split {split}: untouched={untouched}"


def test_splits_outside_a_row_are_neither_written_nor_read(da, monkeypatch):
    """Padded mode attends over the whole pool width (12,288 positions served: 192 splits of 64
    keys per row and KV head), so the split kernel's partials and the combine's reads must follow each row's key
    range, not the grid: on the H200 writing and merging every split cost about 0.5 ms per served
    step. Splits outside ``[start, pos]`` stay untouched, and the output is still exact."""
    handed = poisoned_partials(da, monkeypatch)
    q, k_new, v_new, k_cache, v_cache = inputs(torch.float32, capacity=640, seed=3)
    pos, start = ids(5, 300, 200), ids(0, 140, 0)  # ranges inside the 640-key pool (splits_of names their splits)
    want, _, _ = reference(q, k_new, v_new, k_cache, v_cache, pos, start, 128**-0.5)
    got = da.decode_attention(q, k_new, v_new, k_cache, v_cache, pos, start, 640, 128**-0.5)
    tol = 1e-5 if da.INTERPRETED else 5e-3
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=tol, rtol=tol)  # NaN never passes
    assert handed[0][0].shape[2] == -(-640 // da.SPLIT)  # the pool width's splits, every one checked
    assert_only_used_splits_written(handed, splits_of(da, start, pos))


@pytest.mark.parametrize("split, block", [(32, 64), (96, 64), (64, 24)])
def test_rejects_a_split_that_is_not_whole_tiles(da, monkeypatch, split, block):
    """`SPLIT` must be whole `BLOCK_N` tiles (and the tile a power of two of at least 16): a split of
    32 keys over 64-key tiles walked zero tiles, and on the H100 (2026-12-06) the step died with
    "unspecified launch failure" instead of an error naming the setting."""
    monkeypatch.setattr(da, "SPLIT", split)
    monkeypatch.setattr(da, "BLOCK_N", block)
    q, k_new, v_new, k_cache, v_cache = inputs(torch.float32)
    pos, start = ids(1, 2, 3), ids(0, 0, 0)
    with pytest.raises(ValueError, match="SPLIT .* multiple of BLOCK_N"):
        da.decode_attention(q, k_new, v_new, k_cache, v_cache, pos, start, 64, 1.0)


def test_rejects_mismatched_shapes(da):
    q, k_new, v_new, k_cache, v_cache = inputs(torch.float32)
    pos, start = ids(1, 2, 3), ids(0, 0, 0)
    with pytest.raises(ValueError, match="do not match"):
        da.decode_attention(q[:, :27], k_new, v_new, k_cache, v_cache, pos, start, 64, 1.0)
    with pytest.raises(ValueError, match="beyond the cache"):
        da.decode_attention(q, k_new, v_new, k_cache, v_cache, pos, start, 512, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        da.decode_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k_new, v_new, k_cache, v_cache,
                            pos, start, 64, 1.0)


@pytest.mark.slow  # ~80 s in Triton's CPU interpreter (docs/TESTING.md)
def test_batched_decoder_with_the_fused_kernel_matches_the_reference(da, request):
    """The decoder's vectorised path with the fused kernel: staggered requests of different grids
    give the B=1 reference's tokens, rows within float32 rounding."""
    from test_batch_engine import SPECS, make_seq, run_staggered

    if not da.INTERPRETED:
        pytest.skip("needs a CPU-only machine (the fixture model runs on the CPU); on the GPU benchmarks/ar_decode.py covers this")
    model, tokenizer = request.getfixturevalue("model"), request.getfixturevalue("tokenizer")

    got = run_staggered(model, tokenizer, exact_rows=False, length_bucket=16, fused_attention=True)
    for i, (hidden, seq) in got.items():
        ref = make_seq(model, tokenizer, i)
        ref_hidden, ref_ids = ref.run()
        assert seq.prompt_ids + seq.generated_ids == ref_ids, f"request {i}"
        torch.testing.assert_close(hidden, ref_hidden, atol=2e-5, rtol=0)
    assert len(got) == len(SPECS)


def test_kernel_failure_falls_back_to_the_gemm_path(da, request, monkeypatch, caplog):
    """A Triton failure at the first step (as in an image without a C compiler) leaves a working
    decoder on the GEMM attention path, same tokens."""
    from test_batch_engine import make_seq, run_staggered

    if not da.INTERPRETED:
        pytest.skip("needs a CPU-only machine (Triton's interpreter; the fixture model runs on the CPU)")
    model, tokenizer = request.getfixturevalue("model"), request.getfixturevalue("tokenizer")

    def broken(*args, **kwargs):
        raise RuntimeError("simulated Triton build failure")

    monkeypatch.setattr(da, "decode_attention", broken)
    with caplog.at_level("WARNING", logger="stage_ar.runner"):
        got = run_staggered(model, tokenizer, exact_rows=False, fused_attention=True)
    assert "using the GEMM attention path" in caplog.text
    for i, (_hidden, seq) in got.items():
        assert seq.prompt_ids + seq.generated_ids == make_seq(model, tokenizer, i).run()[1], f"request {i}"


def _decode_padded(model, tok, specs: list[int], **options) -> tuple[dict[int, torch.Tensor], set[int]]:
    """Requests ``specs`` (test_batch_engine's SPECS, joining at once) through a padded (served,
    batch-invariant) `ARModelRunner` with the fused attention: rows per request, and the key lengths
    its steps attended over."""
    from test_batch_engine import grid_ids, make_seq

    from stage_ar.runner import ARModelRunner

    slots = options.pop("num_slots", 2)
    runner = ARModelRunner(model, slots, 160, **dict(zip(("eol_token_id", "visual_token_start_id", "visual_token_end_id"),
                           grid_ids(tok))), exact_rows=False, fused_attention=True, compile=False,
                           pad_to_max_bucket=True, **options)
    rows, first, lengths = {}, 0, set()
    for i in specs:
        seq = make_seq(model, tok, i)
        seq.attach_kv_cache(runner.kv_view(first, seq.cache_batch))
        rows[i] = [seq.prefill().hidden]
        runner.activate(i, seq, first)
        first += seq.cache_batch
    while runner.active_count:
        lengths.add(runner.next_shape()[1])
        pending = runner.launch()
        runner.collect(pending)
        for e in pending.entries:
            rows[e.key].append(pending.hidden[e.slot : e.slot + 1])
    return {i: torch.cat(r) for i, r in rows.items()}, lengths


def test_padded_mode_buckets_key_lengths_with_the_fused_kernel_bit_for_bit(da, request):
    """The served shape (padded: every step runs all slots) attended over the whole pool width at
    every step: a split program per row, KV head and split of 12,288 positions (96), nearly all
    empty (H200, 2026-12-02: 4.30 ms/step at 16 x 12,288 against 4.19 at 8 x 4,224). With the fused
    kernel, whose bits do not depend on the length it is given, padded mode now buckets key lengths
    (doubling from ``length_bucket``): the steps attend over short lengths first, and every row is
    bit for bit the row decoded over the pool width (``length_bucket=0``)."""
    if not da.INTERPRETED:
        pytest.skip("needs a CPU-only machine (the fixture model runs on the CPU); on the GPU benchmarks/ar_decode.py covers this")
    from stage_ar.runner import ARModelRunner
    from test_batch_engine import grid_ids

    model, tokenizer = request.getfixturevalue("model"), request.getfixturevalue("tokenizer")
    ids = dict(zip(("eol_token_id", "visual_token_start_id", "visual_token_end_id"), grid_ids(tokenizer)))
    bucketed, lengths = _decode_padded(model, tokenizer, [4], length_bucket=30)
    whole, whole_lengths = _decode_padded(model, tokenizer, [4], length_bucket=0)
    assert whole_lengths == {160} and len(lengths) >= 2 and max(lengths) < 160, lengths
    for i in bucketed:
        assert torch.equal(bucketed[i], whole[i]), f"request {i}: rows depend on the key-length bucket"
    padded = ARModelRunner(model, 4, 160, **ids, exact_rows=False, fused_attention=True, compile=False,
                           pad_to_max_bucket=True, length_bucket=30)
    assert padded.length_buckets == (30, 60, 120, 160)
    gemm = ARModelRunner(model, 4, 160, **ids, exact_rows=False, fused_attention=False, compile=False,
                         pad_to_max_bucket=True, length_bucket=30)
    assert gemm.length_buckets == (160,)  # the GEMM path's bits depend on the length: one length


def test_trimmed_gemv_rows_keep_every_live_row_bit_for_bit(da, request, monkeypatch):
    """``trim_gemv_rows`` (padded mode): in a pool of four slots the GEMV and attention launches compute only the
    first bucket of rows that holds every live request (the rest of their output unwritten; the bucket
    follows requests leaving), and each request's rows are bit for bit the rows of the untrimmed padded
    decode, through the GEMV kernels (`GemvLinear`) and the fused attention, in Triton's interpreter."""
    if not da.INTERPRETED:
        pytest.skip("needs a CPU-only machine (the fixture model runs on the CPU); on the GPU benchmarks/ar_inprocess_ab.py covers this")
    from stage_ar import gemv as gemv_kernels
    from stage_ar.linear import GemvLinear, set_linear_backend

    model, tokenizer = request.getfixturevalue("model"), request.getfixturevalue("tokenizer")
    computed: list[tuple[int, int | None]] = []
    attended: list[tuple[int, int | None]] = []
    real_gemv, real_attention = gemv_kernels.gemv, da.decode_attention

    def recording(x, weight, **kw):
        computed.append((x.shape[0] if isinstance(x, torch.Tensor) else -1, kw.get("rows")))
        return real_gemv(x, weight, **kw)

    def recording_attention(q, *args, **kw):
        attended.append((q.shape[0], kw.get("rows")))
        return real_attention(q, *args, **kw)

    monkeypatch.setattr(gemv_kernels, "gemv", recording)
    monkeypatch.setattr(da, "decode_attention", recording_attention)
    saved = model.linear_backend
    set_linear_backend(model, GemvLinear())
    try:
        # two requests in slots 0 and 1, the second finishing first: the bucket of live rows goes from
        # 2 to 1 mid-decode, so the first request also decodes alone in slot 0 (which a case of one
        # request in slot 0 covered again, at half of this test's 80 s in CI)
        for specs, bucket_rows in (([0, 4], {2, 1}),):
            computed.clear()
            attended.clear()
            full, _ = _decode_padded(model, tokenizer, specs, num_slots=4, length_bucket=0)
            assert {rows for m, rows in computed if m == 4} == {None}  # every step's launches: all 4 padded rows
            assert {rows for m, rows in attended if m == 4} == {None}
            computed.clear()
            attended.clear()
            trimmed, _ = _decode_padded(model, tokenizer, specs, num_slots=4, length_bucket=0, trim_gemv_rows=True)
            assert {rows for m, rows in computed if m == 4} == bucket_rows  # (the prefills' launches are not the steps')
            assert {rows for m, rows in attended if m == 4} == bucket_rows, "the attention launched idle rows"
            for i in specs:
                assert torch.equal(trimmed[i], full[i]), f"request {i}: a live row's bits changed when idle rows were not computed"
    finally:
        set_linear_backend(model, saved)


def test_the_served_mode_trims_gemv_rows_only_with_the_fused_attention(da, request):
    """The engine's ``batch_invariant`` (served) mode runs the padded shape with ``trim_gemv_rows``
    (measured faster: docs/PERFORMANCE.md, twentieth session); the runner takes it only with the fused
    attention (the GEMM path writes every row's KV, so idle rows must stay computed there) and the
    padded shape, and a caller's ``decoder_options`` still decide."""
    from test_batch_engine import grid_ids

    from stage_ar.engine import DecodeEngine

    model, tokenizer = request.getfixturevalue("model"), request.getfixturevalue("tokenizer")

    def engine(batch_invariant: bool, **options) -> DecodeEngine:
        return DecodeEngine(lambda job: None, 2, model=model, grid_ids=grid_ids(tokenizer), max_sequence_length=160,
                            batch_invariant=batch_invariant, warm_up=False,
                            decoder_options={"exact_rows": False, "compile": False, "cuda_graphs": False, **options})

    assert engine(True, fused_attention=True).runner.trim_gemv_rows
    assert not engine(True, fused_attention=False).runner.trim_gemv_rows
    assert not engine(False, fused_attention=True).runner.trim_gemv_rows
    assert not engine(True, fused_attention=True, trim_gemv_rows=False).runner.trim_gemv_rows


def test_idle_rows_write_no_cache_and_get_zeros(da):
    """``live`` (the padded decode's idle slots): a live row's output and cache write are the ones it
    gets without the mask; an idle row writes nothing into its slot's cache and gets zeros."""
    q, k_new, v_new, k_cache, v_cache = inputs(torch.float16, b=4, seed=5)
    pos, start = ids(200, 17, 99, 64), ids(0, 0, 40, 0)
    live = torch.tensor([True, False, True, False], device=DEVICE)
    full_k, full_v = k_cache.clone(), v_cache.clone()
    full = da.decode_attention(q, k_new, v_new, full_k, full_v, pos, start, 256, 0.1)
    masked_k, masked_v = k_cache.clone(), v_cache.clone()
    masked = da.decode_attention(q, k_new, v_new, masked_k, masked_v, pos, start, 256, 0.1, live=live)
    for i in range(4):
        if live[i]:
            assert torch.equal(masked[i], full[i]), f"row {i}"
            assert torch.equal(masked_k[i], full_k[i]) and torch.equal(masked_v[i], full_v[i])
        else:
            assert not masked[i].any(), f"row {i}"
            assert torch.equal(masked_k[i], k_cache[i]) and torch.equal(masked_v[i], v_cache[i])
    with pytest.raises(ValueError, match="live must be"):
        da.decode_attention(q, k_new, v_new, k_cache, v_cache, pos, start, 256, 0.1, live=live[:3])


def test_rows_computes_only_the_first_rows_with_the_same_bits(da):
    """``rows`` (the served step's live bucket, `stage_ar.runner`'s ``trim_gemv_rows``): the launches
    cover rows ``[0, rows)`` only. Those rows get the untrimmed call's output and cache write bit for
    bit; a row past them reads and writes no cache even with its live flag set, and its output is left
    as allocated."""
    q, k_new, v_new, k_cache, v_cache = inputs(torch.float16, b=4, seed=7)
    pos, start = ids(200, 17, 99, 64), ids(0, 0, 40, 0)
    live = torch.ones(4, dtype=torch.bool, device=DEVICE)
    full_k, full_v = k_cache.clone(), v_cache.clone()
    full = da.decode_attention(q, k_new, v_new, full_k, full_v, pos, start, 256, 0.1, live=live)
    cut_k, cut_v = k_cache.clone(), v_cache.clone()
    cut = da.decode_attention(q, k_new, v_new, cut_k, cut_v, pos, start, 256, 0.1, live=live, rows=2)
    assert cut.shape == full.shape
    for i in range(2):
        assert torch.equal(cut[i], full[i]), f"row {i}"
        assert torch.equal(cut_k[i], full_k[i]) and torch.equal(cut_v[i], full_v[i])
    for i in (2, 3):
        assert torch.equal(cut_k[i], k_cache[i]) and torch.equal(cut_v[i], v_cache[i]), f"row {i} wrote its cache"
    for bad in (0, 5):
        with pytest.raises(ValueError, match="rows must be"):
            da.decode_attention(q, k_new, v_new, k_cache, v_cache, pos, start, 256, 0.1, rows=bad)


def test_amax_out_gathers_each_rows_largest_magnitude(da):
    """``amax_out`` (the W8A8 o_proj's input, `stage_ar.fp8_activations.RowsWithAmax`): the output
    bits are the ones without it, each live row's largest stored magnitude lands in its slot (float32
    bits), idle rows and slots past the batch stay zero; a buffer of the wrong shape is refused."""
    q, k_new, v_new, k_cache, v_cache = inputs(torch.float16, b=4, seed=6)
    pos, start = ids(200, 17, 99, 64), ids(0, 0, 40, 0)
    live = torch.tensor([True, False, True, True], device=DEVICE)
    want = da.decode_attention(q, k_new, v_new, k_cache.clone(), v_cache.clone(), pos, start, 256, 0.1, live=live)
    amax = torch.zeros(16, dtype=torch.int32, device=DEVICE)
    got = da.decode_attention(q, k_new, v_new, k_cache.clone(), v_cache.clone(), pos, start, 256, 0.1, live=live,
                              amax_out=amax)
    assert torch.equal(got, want)
    expect = torch.zeros(16, dtype=torch.float32, device=DEVICE)
    expect[:4] = want.float().abs().amax(dim=1) * live
    assert torch.equal(amax.view(torch.float32), expect) and expect[0] > 0
    with pytest.raises(ValueError, match="amax_out"):
        da.decode_attention(q, k_new, v_new, k_cache, v_cache, pos, start, 256, 0.1, amax_out=amax[:8])


def test_delayed_out_writes_o_projs_codes_with_the_rows_delayed_scale(da):
    """``delayed_out`` (delayed activation scales, `stage_ar.fp8_activations.DelayedOut`): the output bits
    are the ones without it; the codes are each row's output times ``1 / row_scale(DELAYED_MARGIN * a)``
    (``a``: the row's amax one step earlier, in the point's state) in E4M3, zeros for idle rows; each
    live row's largest magnitude is max-ed into the state's gathered half; refused with ``amax_out``."""
    from stage_ar.fp8 import FP8_DTYPE, FP8_MAX
    from stage_ar.fp8_activations import DELAYED_MARGIN, MIN_ROW_SCALE, DelayedOut

    q, k_new, v_new, k_cache, v_cache = inputs(torch.float16, b=4, seed=7)
    pos, start = ids(200, 17, 99, 64), ids(0, 0, 40, 0)
    live = torch.tensor([True, False, True, True], device=DEVICE)
    want = da.decode_attention(q, k_new, v_new, k_cache.clone(), v_cache.clone(), pos, start, 256, 0.1, live=live)
    state = torch.zeros(4 * 32, dtype=torch.int32, device=DEVICE)
    prev = torch.tensor([0.5, 1.0, 0.01, 2.0] + [0.0] * 12, device=DEVICE)
    state[32:48] = prev.view(torch.int32)  # point 1's scales
    got, rows = da.decode_attention(q, k_new, v_new, k_cache.clone(), v_cache.clone(), pos, start, 256, 0.1,
                                    live=live, delayed_out=DelayedOut(state, 1))
    assert torch.equal(got, want) and rows.point == 1 and rows.partials is None
    scales = ((prev[:4].double() * DELAYED_MARGIN) / FP8_MAX).float().clamp_min(MIN_ROW_SCALE)
    codes = (want.float() * (1.0 / scales.double()).float()[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    assert torch.equal(rows.codes.view(torch.uint8), codes.view(torch.uint8))
    assert rows.codes[2].float().abs().max() == FP8_MAX  # row 2 outgrew its tiny delayed amax: saturated
    expect = torch.zeros(16, dtype=torch.float32, device=DEVICE)
    expect[:4] = want.float().abs().amax(dim=1) * live
    assert torch.equal(state[48:64].view(torch.float32), expect) and not state[:32].any()
    with pytest.raises(ValueError, match="amax_out"):
        da.decode_attention(q, k_new, v_new, k_cache, v_cache, pos, start, 256, 0.1, delayed_out=DelayedOut(state, 1),
                            amax_out=torch.zeros(16, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("split", [64, 128])
def test_early_loads_give_the_bits_of_loads_after_the_wait(da, monkeypatch, split):
    """`EARLY_LOADS` (on by default) loads each row's key range and live flag and each split's first tile of
    cached keys/values before the PDL wait. The values are the same, so the output and the cache must
    be the same bits as with every load after the wait: for a split of one tile (the default) and of
    two (the second tile loaded in the loop), rows whose new position sits in a split's first or second
    tile, a range starting past zero, an idle row; and the reference within tolerance."""
    monkeypatch.setattr(da, "SPLIT", split)
    q, k_new, v_new, k_cache, v_cache = inputs(torch.float16, b=5, capacity=320, seed=7)
    pos, start = ids(5, 63, 200, 300, 150), ids(0, 10, 64, 130, 0)
    live = torch.tensor([True, True, True, True, False], device=DEVICE)
    got = {}
    for early in (False, True):
        monkeypatch.setattr(da, "EARLY_LOADS", early)
        k, v = k_cache.clone(), v_cache.clone()
        got[early] = (da.decode_attention(q, k_new, v_new, k, v, pos, start, 320, 0.1, live=live), k, v)
    for late, early in zip(got[False], got[True]):
        assert torch.equal(late, early)
    want, _, _ = reference(q[:4], k_new[:4], v_new[:4], k_cache[:4], v_cache[:4], pos[:4], start[:4], 0.1)
    torch.testing.assert_close(got[True][0][:4].float().cpu(), want.float(), atol=2e-3, rtol=2e-3)
    assert not got[True][0][4].any()


@pytest.mark.parametrize("chunk", [2, 4])
def test_merge_in_chunks_reads_only_a_rows_splits_and_is_batch_invariant(da, monkeypatch, chunk):
    """`MERGE_CHUNK` (opt-in): the combine sums a row's splits ``chunk`` at a time, over the chunks
    that overlap the row's splits only. With every split slot the kernels do not write poisoned (a
    chunk that read one would turn the row NaN) it matches the reference; a row alone has the bits it
    has in a batch and in a longer length bucket; and a chunk as wide as the pool's split slots (here
    16: 640 positions at 64 keys) gives the bits of the one-tile merge."""
    monkeypatch.setattr(da, "SPLIT", 64)
    monkeypatch.setattr(da, "MERGE_CHUNK", chunk)
    q, k_new, v_new, k_cache, v_cache = inputs(torch.float32, capacity=640, seed=3)
    pos, start = ids(5, 300, 200), ids(0, 140, 0)
    want, _, _ = reference(q, k_new, v_new, k_cache, v_cache, pos, start, 128**-0.5)
    handed = poisoned_partials(da, monkeypatch)
    got = da.decode_attention(q, k_new, v_new, k_cache.clone(), v_cache.clone(), pos, start, 640, 128**-0.5)
    tol = 1e-5 if da.INTERPRETED else 5e-3
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=tol, rtol=tol)  # NaN never passes
    assert_only_used_splits_written(handed, splits_of(da, start, pos))
    for i in range(3):  # (the workspaces stay poisoned: a merge that read a stray slot would show)
        one = slice(i, i + 1)
        alone = da.decode_attention(q[one], k_new[one], v_new[one], k_cache[one].clone(), v_cache[one].clone(),
                                    pos[one], start[one], int(pos[i]) + 1, 128**-0.5)
        assert torch.equal(alone[0], got[i]), f"row {i}"
    bits = {}
    for merge in (0, 16):
        monkeypatch.setattr(da, "MERGE_CHUNK", merge)
        bits[merge] = da.decode_attention(q, k_new, v_new, k_cache.clone(), v_cache.clone(), pos, start, 640, 0.1)
    assert torch.equal(bits[0], bits[16])
    monkeypatch.setattr(da, "MERGE_CHUNK", 3)
    with pytest.raises(ValueError, match="MERGE_CHUNK"):
        da.decode_attention(q, k_new, v_new, k_cache.clone(), v_cache.clone(), pos, start, 640, 0.1)
