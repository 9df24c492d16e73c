"""The DiT's fast attention and rotary paths give what the reference forms give (CPU, float32)."""

import pytest
import torch

from stage_dit.modules import (
    apply_rotary_emb,
    apply_rotary_emb_complex,
    masked_attention,
    rotary_axis_table,
    rotary_complex,
)


def test_key_lengths_path_equals_the_masked_path_for_every_row():
    g = torch.Generator().manual_seed(0)
    b, s, heads, kv, d = 4, 11, 6, 2, 8
    q = torch.randn(b, s, heads, d, generator=g)
    k = torch.randn(b, s, kv, d, generator=g)
    v = torch.randn(b, s, kv, d, generator=g)
    lengths = [11, 7, 0, 7]  # full, padded, all padding (attends to every key), padded again
    mask = torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]
    reference = masked_attention(q, k, v, mask)
    fast = masked_attention(q, k, v, None, lengths)
    assert fast.shape == (b, s, heads * d)
    # padding query rows too: the caller relies only on real rows, but both forms agree on all of them
    assert torch.allclose(fast, reference, atol=1e-5)
    # all lengths full: one unmasked call, equal to no padding at all
    assert torch.allclose(masked_attention(q, k, v, None, [s] * b), masked_attention(q, k, v, None), atol=1e-6)


def test_key_lengths_must_match_the_batch():
    q = torch.randn(2, 3, 2, 4)
    k = torch.randn(2, 3, 1, 4)
    try:
        masked_attention(q, k, k, None, [3])
    except ValueError as err:
        assert "key_lengths" in str(err)
    else:
        raise AssertionError("expected ValueError")


def test_complex_rotary_equals_the_pairwise_formula():
    g = torch.Generator().manual_seed(1)
    cos, sin = rotary_axis_table(16, 40)
    pos = torch.randint(0, 40, (2, 9), generator=g)
    c, sn = cos[pos], sin[pos]
    x = torch.randn(2, 9, 3, 16, generator=g)
    ref = apply_rotary_emb(x, c, sn)
    fast = apply_rotary_emb_complex(x, rotary_complex(c, sn))
    assert torch.allclose(fast, ref, atol=1e-6)
    xb = x.bfloat16()
    assert apply_rotary_emb_complex(xb, rotary_complex(c, sn)).dtype == torch.bfloat16


def test_right_padded_lengths():
    from stage_dit.modules import right_padded_lengths

    mask = torch.tensor([[True, True, False], [False, False, False], [True, True, True]])
    assert right_padded_lengths(mask) == [2, 0, 3]
    with pytest.raises(ValueError, match="right-padded"):
        right_padded_lengths(torch.tensor([[True, False, True]]))
