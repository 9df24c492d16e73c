"""The DiT's fused Triton kernels (`stage_dit.fused`) against the eager modules they replace.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (`tests/conftest.py` sets
``TRITON_INTERPRET=1``); on CUDA they run compiled. The served CPU path never takes them
(`fused.enabled` is false there), which `test_cpu_block_never_takes_the_fused_path` pins down.
"""

from __future__ import annotations

import pytest
import torch

from stage_dit import fused
from stage_dit.modules import RMSNorm, apply_rotary_emb_complex, rotary_axis_table, rotary_complex
from stage_dit.transformer_mammoth import MammothTransformerBlock

pytestmark = pytest.mark.skipif(fused.triton is None, reason="needs triton")


def device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if not fused.INTERPRETED:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    return "cpu"


def norm(dim: int, seed: int) -> RMSNorm:
    module = RMSNorm(dim, eps=1e-5)
    module.weight.data = torch.randn(dim, generator=torch.Generator().manual_seed(seed))
    return module.to(device())


def rope(b: int, s: int, d: int) -> torch.Tensor:
    cos, sin = rotary_axis_table(d, 64)
    pos = torch.randint(0, 64, (b, s), generator=torch.Generator().manual_seed(5))
    return rotary_complex(cos[pos], sin[pos]).to(device())


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device())


def test_kernels_match_the_eager_ops():
    b, s, d, heads, hd = 3, 12, 72, 4, 18
    x, y = rand(b, s, d, seed=1), rand(b, s, d, seed=2)
    mods = rand(4, 4 * d, seed=3)  # padded temb rows, chunked views as `RMSNormZero.modulations` gives
    scale, gate = mods[:b, :d], mods[:b, d : 2 * d]
    n = norm(d, 4)
    tol = dict(atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(fused.rms_norm_modulate(x, n.weight, 1e-5, scale), n(x) * (1 + scale[:, None]), **tol)
    torch.testing.assert_close(fused.rms_norm_modulate(x, n.weight, 1e-5), n(x), **tol)
    torch.testing.assert_close(fused.gated_residual(x, y, n.weight, 1e-5, gate), x + gate[:, None].tanh() * n(y), **tol)
    torch.testing.assert_close(fused.gated_residual(x, y, n.weight, 1e-5), x + n(y), **tol)
    q, qn, r = rand(b, s, heads, hd, seed=6), norm(hd, 7), rope(b, s, hd)
    torch.testing.assert_close(fused.qk_norm_rope(q, qn.weight, 1e-5, r), apply_rotary_emb_complex(qn(q), r), **tol)
    a, g = rand(5, 333, seed=8), rand(5, 333, seed=9)
    torch.testing.assert_close(fused.silu_mul(a, g), torch.nn.functional.silu(a) * g, **tol)


def test_rows_do_not_depend_on_the_batch():
    d = 40
    x, y, n = rand(5, 7, d, seed=1), rand(5, 7, d, seed=2), norm(d, 3)
    scale = rand(8, d, seed=4)
    batched = fused.gated_residual(x, y, n.weight, 1e-5, scale)
    for i in range(5):
        alone = fused.gated_residual(x[i : i + 1].contiguous(), y[i : i + 1].contiguous(), n.weight, 1e-5,
                                     scale[i : i + 1])
        assert torch.equal(batched[i : i + 1], alone)


def test_bad_layouts_are_refused():
    x = rand(2, 3, 8)
    with pytest.raises(ValueError):
        fused.rms_norm_modulate(x.transpose(0, 1), torch.ones(8, device=x.device), 1e-5)
    with pytest.raises(ValueError):
        fused.gated_residual(x, x[:1].contiguous(), torch.ones(8, device=x.device), 1e-5)
    with pytest.raises(ValueError):
        fused.qk_norm_rope(rand(2, 3, 2, 4), torch.ones(4, device=x.device), 1e-5, rope(2, 2, 4))


@pytest.mark.parametrize("modulation", [True, False])
def test_fused_block_matches_the_eager_block(monkeypatch, modulation):
    torch.manual_seed(0)
    block = MammothTransformerBlock(48, 4, 2, 16, None, 1e-5, modulation=modulation).to(device())
    for p in block.parameters():
        p.data = torch.randn_like(p) * 0.3
    h, temb, r = rand(2, 10, 48, seed=1), rand(4, 48, seed=2), rope(2, 10, 12)
    with torch.inference_mode():
        monkeypatch.setattr(fused, "ENABLED", False)
        eager = block(h, None, r, temb if modulation else None, key_lengths=[10, 7])
        monkeypatch.setattr(fused, "enabled", lambda x: True)  # the kernels, on whatever device
        out = block(h, None, r, temb if modulation else None, key_lengths=[10, 7])
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)


def test_cpu_block_never_takes_the_fused_path():
    assert not fused.enabled(torch.zeros(2, dtype=torch.bfloat16))
    assert not fused.enabled(torch.zeros(2))
