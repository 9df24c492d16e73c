"""Delayed activation scales for W8A8 (`stage_ar.fp8_activations.DelayedOut` / `DelayedRows`, issue 17's
experiment): the producing GEMV writes its output rows as E4M3 codes with the scale the row's amax had at
the same point one step earlier, the consuming GEMV multiplies those codes, and no quantizer launch sits
between them. Checked bit for bit against the W8A8 launch on the same codes and scales (`QuantizedRows`),
and against torch references of the codes, the amax, the norm's sums of squares and the state's roll.
Runs in Triton's interpreter on the CPU (float16 activations), compiled on a GPU (bfloat16)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, INNER = 96, 40  # a hidden size of three norm groups, SwiGLU columns


@pytest.fixture
def gemv():
    import stage_ar.gemv as module

    if not module.available(torch.device(DEVICE)):
        pytest.skip("triton cannot run here (no CUDA, interpreter off)")
    return module


def _fp8(rows: int, k: int, g: torch.Generator, dtype: torch.dtype):
    from stage_ar.fp8 import quantize_fp8_per_channel

    w, s = quantize_fp8_per_channel((torch.randn(rows, k, generator=g) / k**0.5).to(dtype))
    return w.to(DEVICE), s.to(DEVICE)


def _scales(prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' delayed row scales and their inverses from a point's previous amax (float32), each
    division correctly rounded (as `stage_ar.gemv_reference.quantize_rows_reference` takes them)."""
    from stage_ar.fp8 import FP8_MAX
    from stage_ar.fp8_activations import DELAYED_MARGIN, MIN_ROW_SCALE

    scales = ((prev.double() * DELAYED_MARGIN) / FP8_MAX).float().clamp_min(MIN_ROW_SCALE)
    return scales, (1.0 / scales.double()).float()


def _codes(t: torch.Tensor, inverses: torch.Tensor) -> torch.Tensor:
    from stage_ar.fp8 import FP8_DTYPE, FP8_MAX

    return (t.float() * inverses[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _point(state: torch.Tensor, point: int, half: int) -> torch.Tensor:
    """16 rows' amax (float32) in ``half`` 0 (what this step's scales read) or 1 (gathered) of ``point``."""
    return state[32 * point + 16 * half:32 * point + 16 * half + 16].view(torch.float32)


@pytest.mark.parametrize("rows", [16, 1])
def test_delayed_scales_chain_gives_the_bits_of_the_w8a8_launch_on_the_same_codes(gemv, rows):
    """A layer's MLP and o_proj under delayed scales: o_proj adds the residual and writes gate_up's input
    as codes of ``(o + residual) * norm_weight`` with the delayed scale, plus each row's sums of squares
    per 32 columns; gate_up (SwiGLU) reads them, applies the inverse RMS from those sums, and writes
    down's input codes; down reads those. Every launch's bf16 output equals the W8A8 launch on the same
    codes with the same scales (`QuantizedRows`); the codes equal torch's; each point's gathered amax is
    the rows' largest magnitude; a row alone gets the bits it gets among 16."""
    from stage_ar.fp8_activations import DelayedOut, DelayedRows, QuantizedRows, delayed_state

    dtype = torch.float16 if gemv.INTERPRETED else torch.bfloat16
    g = torch.Generator().manual_seed(5)
    w_o, s_o = _fp8(H, 64, g, dtype)
    w_gu, s_gu = _fp8(2 * INNER, H, g, dtype)
    w_down, s_down = _fp8(H, INNER, g, dtype)
    nw = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).to(DEVICE)
    residual = (3 * torch.randn(16, H, generator=g)).to(dtype).to(DEVICE)[:rows]
    attn = torch.randn(16, 64, generator=g).to(dtype).to(DEVICE)[:rows]
    state = delayed_state(w_o)
    state.zero_()
    prev = torch.rand(16, generator=g) * 3 + 0.5
    for point in range(4):  # this step's scales: the amax "seen last step"
        _point(state, point, 0).copy_(prev.to(DEVICE) * (point + 1))
    config = gemv.GemvConfig(64, 4, 3)
    codes_o, scales_o = _codes(attn, _scales(_point(state, 0, 0)[:rows])[1]), _scales(_point(state, 0, 0)[:rows])[0]
    o_in = DelayedRows(codes_o, state, 0, None, 1e-6, dtype, attn)

    summed, gu_in = gemv.gemv(o_in, w_o, weight_scale=s_o, residual=residual, config=config,
                              delayed_out=DelayedOut(state, 1, nw, 1e-6))
    want = gemv.gemv(QuantizedRows(codes_o, scales_o, dtype, codes_o.shape), w_o, weight_scale=s_o,
                     residual=residual, config=config)
    assert torch.equal(summed, want)
    t = summed.float() * nw.float()
    scales_gu, inv_gu = _scales(_point(state, 1, 0)[:rows])
    assert torch.equal(gu_in.codes.view(torch.uint8), _codes(t, inv_gu).view(torch.uint8))
    assert torch.equal(_point(state, 1, 1)[:rows], t.abs().amax(dim=1))
    squares = gu_in.partials[:rows].double().sum(dim=1)
    torch.testing.assert_close(squares, summed.double().square().sum(dim=1), rtol=1e-6, atol=0)

    hidden, down_in = gemv.gemv(gu_in, w_gu, weight_scale=s_gu, swiglu=True, config=config,
                                delayed_out=DelayedOut(state, 2))
    inv_rms = torch.rsqrt(gu_in.partials[:rows].sum(dim=1) / H + 1e-6)
    want = gemv.gemv(QuantizedRows(gu_in.codes, scales_gu * inv_rms, dtype, gu_in.codes.shape), w_gu,
                     weight_scale=s_gu, swiglu=True, config=config)
    torch.testing.assert_close(hidden.float(), want.float(), rtol=2e-3, atol=2e-3)  # the RMS's sum order
    scales_down, inv_down = _scales(_point(state, 2, 0)[:rows])
    assert torch.equal(down_in.codes.view(torch.uint8), _codes(hidden, inv_down).view(torch.uint8))
    assert torch.equal(_point(state, 2, 1)[:rows], hidden.float().abs().amax(dim=1))

    out = gemv.gemv(down_in, w_down, weight_scale=s_down, residual=summed, config=config)
    want = gemv.gemv(QuantizedRows(down_in.codes, scales_down, dtype, down_in.codes.shape), w_down,
                     weight_scale=s_down, residual=summed, config=config)
    assert torch.equal(out, want)


def test_a_row_alone_gets_its_bits_among_sixteen(gemv):
    """Batch invariance under delayed scales: row 5 of a 16-row chain (o_proj with the norm's codes, then
    gate_up on them) is bit for bit the chain of row 5 alone with the same state."""
    from stage_ar.fp8_activations import DelayedOut, DelayedRows, delayed_state

    dtype = torch.float16 if gemv.INTERPRETED else torch.bfloat16
    g = torch.Generator().manual_seed(9)
    w_o, s_o = _fp8(H, 64, g, dtype)
    w_gu, s_gu = _fp8(2 * INNER, H, g, dtype)
    nw = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).to(DEVICE)
    residual = torch.randn(16, H, generator=g).to(dtype).to(DEVICE)
    attn = torch.randn(16, 64, generator=g).to(dtype).to(DEVICE)
    state = delayed_state(w_gu)
    config = gemv.GemvConfig(64, 4, 3)

    def chain(lo, hi):
        state.zero_()
        for point in range(4):
            _point(state, point, 0).copy_(torch.linspace(0.5, 4.0, 16, device=DEVICE))
        codes = _codes(attn[lo:hi], _scales(_point(state, 0, 0)[lo:hi])[1])
        # the state's rows are the batch's rows: a row alone is row 0 of its launch
        if lo:
            for point in range(4):
                _point(state, point, 0)[0] = _point(state, point, 0)[lo].clone()
        summed, gu_in = gemv.gemv(DelayedRows(codes, state, 0, None, 1e-6, dtype, attn[lo:hi]), w_o, weight_scale=s_o,
                                  residual=residual[lo:hi], config=config, delayed_out=DelayedOut(state, 1, nw))
        hidden = gemv.gemv(gu_in, w_gu, weight_scale=s_gu, swiglu=True, config=config)
        return summed, hidden, gu_in.codes

    s16, h16, c16 = chain(0, 16)
    s1, h1, c1 = chain(5, 6)
    assert torch.equal(s1[0], s16[5]) and torch.equal(h1[0], h16[5])
    assert torch.equal(c1[0].view(torch.uint8), c16[5].view(torch.uint8))


def test_roll_moves_the_gathered_amax_to_the_next_steps_half_and_zeroes_it(gemv):
    """``roll=``: the launch's first program copies each point's gathered 16 amax over the 16 this step's
    scales read, and zeroes the gathered ones; the launch's own output is unchanged by it."""
    from stage_ar.fp8_activations import DELAYED_POINTS, delayed_state

    dtype = torch.float16 if gemv.INTERPRETED else torch.bfloat16
    g = torch.Generator().manual_seed(3)
    w, s = _fp8(48, H, g, dtype)
    x = torch.randn(4, H, generator=g).to(dtype).to(DEVICE)
    state = delayed_state(w)
    state.copy_(torch.arange(len(DELAYED_POINTS) * 32, dtype=torch.int32, device=DEVICE))
    before = state.clone().view(len(DELAYED_POINTS), 2, 16)
    config = gemv.GemvConfig(64, 4, 3)
    out = gemv.gemv(x, w, weight_scale=s, fp8_compute="fp8", config=config, roll=state)
    after = state.view(len(DELAYED_POINTS), 2, 16)
    assert torch.equal(after[:, 0], before[:, 1]) and not after[:, 1].any()
    assert torch.equal(out, gemv.gemv(x, w, weight_scale=s, fp8_compute="fp8", config=config))


def test_a_row_that_outgrows_its_margin_saturates_and_its_amax_is_kept_for_the_next_step(gemv):
    """The scheme's one numerical risk, pinned down: a row whose values grow past `DELAYED_MARGIN` times
    last step's amax in one step saturates at +-448 (the E4M3 conversion's satfinite), and the point's
    gathered amax is the row's true one, so the next step's scale covers it."""
    from stage_ar.fp8 import FP8_MAX
    from stage_ar.fp8_activations import DELAYED_MARGIN, DelayedOut, delayed_state

    dtype = torch.float16 if gemv.INTERPRETED else torch.bfloat16
    g = torch.Generator().manual_seed(4)
    w, s = _fp8(2 * INNER, H, g, dtype)
    x = torch.randn(2, H, generator=g).to(dtype).to(DEVICE)
    state = delayed_state(w)
    state.zero_()
    hidden = gemv.gemv(x, w, weight_scale=s, swiglu=True, fp8_compute="fp8", config=gemv.GemvConfig(64, 4, 3))
    amax = hidden.float().abs().amax(dim=1)
    _point(state, 2, 0).copy_(torch.stack([amax[0], amax[1] / (4 * DELAYED_MARGIN)]).repeat(8))
    _, rows = gemv.gemv(x, w, weight_scale=s, swiglu=True, fp8_compute="fp8", config=gemv.GemvConfig(64, 4, 3),
                        delayed_out=DelayedOut(state, 2))
    codes = rows.codes.float().abs().amax(dim=1)
    assert codes[0] == FP8_MAX / DELAYED_MARGIN  # within the margin: the row's amax lands at 448 / margin
    assert codes[1] == FP8_MAX  # outgrew it: saturated
    assert torch.equal(_point(state, 2, 1)[:2], amax)


def test_delayed_forms_refuse_what_they_cannot_take(gemv):
    """DelayedRows need E4M3 weights and W8A8, without a norm; ``delayed_out`` needs a W8A8 launch and
    does not combine with RoPE or ``amax_out``; its norm weight is the output's width."""
    from stage_ar.fp8_activations import DelayedOut, DelayedRows, amax_buffers, delayed_state

    dtype = torch.float16
    g = torch.Generator().manual_seed(2)
    w, s = _fp8(48, H, g, dtype)
    x = torch.randn(2, H, generator=g).to(dtype).to(DEVICE)
    state = delayed_state(w)
    rows = DelayedRows(torch.zeros(2, H, device=DEVICE).to(w.dtype), state, 0, None, 1e-6, dtype, x)
    with pytest.raises(ValueError, match="E4M3 weights"):
        gemv.gemv(rows, w.to(dtype))
    with pytest.raises(ValueError, match="no norm_weight"):
        gemv.gemv(rows, w, weight_scale=s, norm_weight=torch.ones(H, dtype=dtype, device=DEVICE))
    with pytest.raises(ValueError, match="W8A8"):
        gemv.gemv(x, w.to(dtype), delayed_out=DelayedOut(state, 1))
    with pytest.raises(ValueError, match="amax_out"):
        gemv.gemv(x, w, weight_scale=s, fp8_compute="fp8", amax_out=amax_buffers(w)[0], delayed_out=DelayedOut(state, 1))
    with pytest.raises(ValueError, match="norm_weight"):
        gemv.gemv(x, w, weight_scale=s, fp8_compute="fp8", delayed_out=DelayedOut(state, 1, torch.ones(H, dtype=dtype,
                                                                                                          device=DEVICE)))


def test_a_fresh_row_is_quantized_by_its_consumer_with_this_steps_amax(gemv):
    """A row starting its request (`mark_fresh`: its state amax `FRESH`) has no amax of its own from a
    step before: its consumer quantizes it from its values with the amax the producer gathered in this
    step, i.e. per-row W8A8's codes and scale. o_proj on a fresh row gives the bits of the W8A8 launch on
    `quantize_rows`' codes (the other rows, not fresh, keep their delayed codes' bits), and gate_up on
    o_proj's fresh output matches the launch on the per-row codes of the normalised rows. The roll then
    keeps this step's amax for the next step (and `FRESH` where nothing was gathered)."""
    from stage_ar.fp8 import FP8_DTYPE
    from stage_ar.fp8_activations import FRESH, DelayedOut, DelayedRows, QuantizedRows, delayed_state, mark_fresh
    from stage_ar.gemv_reference import quantize_rows_reference

    dtype = torch.float16 if gemv.INTERPRETED else torch.bfloat16
    g = torch.Generator().manual_seed(11)
    w_o, s_o = _fp8(H, 64, g, dtype)
    w_gu, s_gu = _fp8(2 * INNER, H, g, dtype)
    nw = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).to(DEVICE)
    residual = (3 * torch.randn(4, H, generator=g)).to(dtype).to(DEVICE)
    attn = torch.randn(4, 64, generator=g).to(dtype).to(DEVICE)
    state = delayed_state(w_o)
    state.zero_()
    for point in range(4):
        _point(state, point, 0)[:4] = torch.tensor([0.5, 1.0, 2.0, 4.0], device=DEVICE)
    mark_fresh(slice(1, 3), torch.device(DEVICE))  # rows 1 and 2 start a request
    fresh_bits = torch.tensor(FRESH).view(torch.int32).item()
    assert (state.view(4, 2, 16)[:, 0, 1:3] == fresh_bits).all() and not state.view(4, 2, 16)[:, 1].any()
    _point(state, 0, 1)[:4] = attn.float().abs().amax(dim=1)  # what the combine gathers this step
    config = gemv.GemvConfig(64, 4, 3)
    _, inverses = _scales(_point(state, 0, 0)[:4])
    codes = _codes(attn, inverses)  # the combine's delayed codes (fresh rows' saturated: replaced below)
    summed, gu_in = gemv.gemv(DelayedRows(codes, state, 0, None, 1e-6, dtype, attn), w_o, weight_scale=s_o,
                              residual=residual, config=config, delayed_out=DelayedOut(state, 1, nw))
    ref_codes, ref_scales = quantize_rows_reference(attn)
    mixed_codes = torch.where(torch.tensor([False, True, True, False], device=DEVICE)[:, None],
                              ref_codes.view(torch.uint8), codes.view(torch.uint8)).view(FP8_DTYPE)
    delayed_scales = _scales(_point(state, 0, 0)[:4])[0]
    mixed_scales = torch.where(torch.tensor([False, True, True, False], device=DEVICE), ref_scales, delayed_scales)
    want = gemv.gemv(QuantizedRows(mixed_codes, mixed_scales, dtype, attn.shape), w_o, weight_scale=s_o,
                     residual=residual, config=config)
    assert torch.equal(summed, want)

    hidden = gemv.gemv(gu_in, w_gu, weight_scale=s_gu, swiglu=True, config=config)
    normed = summed.float() * nw.float()
    inv_rms = torch.rsqrt(gu_in.partials[:4].sum(dim=1) / H + 1e-6)
    ref_codes, ref_scales = quantize_rows_reference(normed)
    assert torch.equal(_point(state, 1, 1)[:4], normed.abs().amax(dim=1))
    want = gemv.gemv(QuantizedRows(ref_codes, ref_scales * inv_rms, dtype, normed.shape), w_gu, weight_scale=s_gu,
                     swiglu=True, config=config)
    torch.testing.assert_close(hidden[1:3].float(), want[1:3].float(), rtol=2e-3, atol=2e-3)

    x = torch.randn(4, H, generator=g).to(dtype).to(DEVICE)
    gemv.gemv(x, w_gu[:48], weight_scale=s_gu[:48], fp8_compute="fp8", config=config, roll=state)  # the next qkv
    kept = state.view(4, 2, 16)
    assert torch.equal(kept[1, 0, :4].view(torch.float32), normed.abs().amax(dim=1))  # gathered -> kept
    assert (kept[2, 0, 1:3] == fresh_bits).all()  # nothing gathered at down's point: still fresh
    assert not kept[:, 1].any()
