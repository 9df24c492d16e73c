"""`stage_ar.decode_attention.window_attention`: ``T`` causal queries per row (Jacobi windows), KV
write fused, against a float64 reference; window 1 equals the one-query kernel bit for bit; a row's
bits do not depend on the batch. Triton's interpreter on CPU (`tests/conftest.py`), compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 128**-0.5


@pytest.fixture
def da():
    import stage_ar.decode_attention as module

    if not module.available(torch.device(DEVICE)):
        pytest.skip("triton cannot run here (no CUDA, interpreter off)")
    return module


def reference(q, k_new, v_new, k_cache, v_cache, slots, pos, start, scale):
    """Write the window's keys/values, then causal softmax attention in float64 per query."""
    q, k_new, v_new, k_cache, v_cache = (t.cpu() for t in (q, k_new, v_new, k_cache, v_cache))
    r, window, heads, d = q.shape
    kv_heads = k_new.shape[2]
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    out = torch.empty(r, window, heads * d, dtype=q.dtype)
    for i, (s, p, a) in enumerate(zip(slots.tolist(), pos.tolist(), start.tolist())):
        k_cache[s, :, p : p + window] = k_new[i].transpose(0, 1)
        v_cache[s, :, p : p + window] = v_new[i].transpose(0, 1)
        for t in range(window):
            keys = k_cache[s, :, a : p + t + 1].double()
            values = v_cache[s, :, a : p + t + 1].double()
            qg = q[i, t].double().view(kv_heads, heads // kv_heads, d)
            probs = torch.softmax(qg @ keys.transpose(-1, -2) * scale, dim=-1)
            out[i, t] = (probs @ values).reshape(-1).to(q.dtype)
    return out, k_cache, v_cache


def inputs(dtype, r, window, heads=28, kv_heads=4, d=128, slots=4, capacity=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(r, window, heads, d, generator=g).to(dtype)
    qkv = torch.randn(r, window, 2 * kv_heads * d + 8, generator=g).to(dtype)  # strided views, as the model's
    k_new = qkv[..., : kv_heads * d].view(r, window, kv_heads, d)
    v_new = qkv[..., kv_heads * d : 2 * kv_heads * d].view(r, window, kv_heads, d)
    k_cache = torch.randn(slots, kv_heads, capacity, d, generator=g).to(dtype)
    v_cache = torch.randn(slots, kv_heads, capacity, d, generator=g).to(dtype)
    return tuple(t.to(DEVICE) for t in (q, k_new, v_new, k_cache, v_cache))


def ids(*values):
    return torch.tensor(values, device=DEVICE)


@pytest.mark.parametrize("window", [3, 16])
def test_matches_reference_and_writes_the_window(da, window):
    tol = 1e-5 if da.INTERPRETED else 5e-3  # float32 tl.dot runs in TF32 on the GPU
    q, k_new, v_new, k_cache, v_cache = inputs(torch.float32, 3, window)
    slots = ids(2, 0, 3)  # not the row order: the slot indirection
    pos = ids(5, 120, 60)  # row 1's window crosses a tile and a split boundary (128), row 2's a tile (64)
    start = ids(0, 3, 40)
    want, want_k, want_v = reference(q, k_new, v_new, k_cache, v_cache, slots, pos, start, SCALE)
    got = da.window_attention(q, k_new, v_new, k_cache, v_cache, slots, pos, start, 192, SCALE)
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(k_cache.cpu(), want_k) and torch.equal(v_cache.cpu(), want_v)


def test_window_one_is_the_decode_kernel_bit_for_bit(da):
    q, k_new, v_new, k_cache, v_cache = inputs(torch.float16, 3, 1, slots=3, seed=2)
    pos, start = ids(5, 130, 64), ids(0, 3, 64)
    k1, v1 = k_cache.clone(), v_cache.clone()
    want = da.decode_attention(q[:, 0], k_new[:, 0], v_new[:, 0], k1, v1, pos, start, 192, SCALE)
    got = da.window_attention(q, k_new, v_new, k_cache, v_cache, ids(0, 1, 2), pos, start, 192, SCALE)
    assert torch.equal(got[:, 0], want)
    assert torch.equal(k_cache, k1) and torch.equal(v_cache, v1)


def test_rows_are_batch_and_length_invariant(da):
    window = 4
    q, k_new, v_new, k_cache, v_cache = inputs(torch.float16, 4, window, seed=1)
    slots, pos, start = ids(0, 1, 2, 3), ids(200, 17, 99, 60), ids(0, 0, 40, 0)
    batch = da.window_attention(q, k_new, v_new, k_cache.clone(), v_cache.clone(), slots, pos, start, 256, 0.1)
    for i in range(4):
        one = slice(i, i + 1)
        alone = da.window_attention(q[one], k_new[one], v_new[one], k_cache.clone(), v_cache.clone(), slots[one],
                                    pos[one], start[one], int(pos[i]) + window if i else 256, 0.1)
        assert torch.equal(alone[0], batch[i]), f"row {i}"


def test_splits_outside_a_window_are_neither_written_nor_read(da, monkeypatch):
    """As the decode kernel's (`test_decode_attention`): a row's window reads keys
    ``[start, pos + T - 1]``; splits outside that range are not written, and the combine reads
    none of them (the workspace is NaN-poisoned, so a stray read shows)."""
    from test_decode_attention import assert_only_used_splits_written, poisoned_partials, splits_of

    handed = poisoned_partials(da, monkeypatch)
    window = 3
    q, k_new, v_new, k_cache, v_cache = inputs(torch.float32, 3, window, capacity=640, seed=4)
    slots, pos, start = ids(1, 3, 0), ids(2, 254, 200), ids(0, 140, 0)  # ranges: {0}, {1, 2}, {0, 1}
    want, _, _ = reference(q, k_new, v_new, k_cache, v_cache, slots, pos, start, SCALE)
    got = da.window_attention(q, k_new, v_new, k_cache, v_cache, slots, pos, start, 640, SCALE)
    tol = 1e-5 if da.INTERPRETED else 5e-3
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=tol, rtol=tol)
    assert handed[0][0].shape[2] == -(-640 // da.SPLIT)  # the pool width's splits, every one checked
    assert_only_used_splits_written(handed, splits_of(da, start, pos + window - 1))


def test_rejects_mismatched_shapes(da):
    q, k_new, v_new, k_cache, v_cache = inputs(torch.float32, 2, 2)
    slots, pos, start = ids(0, 1), ids(1, 2), ids(0, 0)
    with pytest.raises(ValueError, match="do not match"):
        da.window_attention(q[:, :1], k_new, v_new, k_cache, v_cache, slots, pos, start, 64, 1.0)
    with pytest.raises(ValueError, match="must be"):
        da.window_attention(q, k_new, v_new, k_cache, v_cache, slots[:1], pos, start, 64, 1.0)
    with pytest.raises(ValueError, match="beyond the cache"):
        da.window_attention(q, k_new, v_new, k_cache, v_cache, slots, pos, start, 512, 1.0)


def test_merge_in_chunks_matches_the_reference(da, monkeypatch):
    """`MERGE_CHUNK` (opt-in) in the window combine: two splits at a time over a row's own splits,
    rows whose windows cross split boundaries, against the float64 reference."""
    monkeypatch.setattr(da, "MERGE_CHUNK", 2)
    tol = 1e-5 if da.INTERPRETED else 5e-3
    q, k_new, v_new, k_cache, v_cache = inputs(torch.float32, 3, 3, capacity=512, seed=4)
    slots, pos, start = ids(2, 0, 3), ids(5, 250, 130), ids(0, 3, 70)
    want, _, _ = reference(q, k_new, v_new, k_cache, v_cache, slots, pos, start, SCALE)
    got = da.window_attention(q, k_new, v_new, k_cache, v_cache, slots, pos, start, 384, SCALE)
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=tol, rtol=tol)
