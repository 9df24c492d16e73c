"""The AR forward's linear backends (`stage_ar.linear`): the Triton GEMV kernels wired into the one
forward, against the upstream reference fixture and the torch backend, and batch invariance.

On CPU the kernels run in Triton's interpreter (`tests/conftest.py`), float32 (numpy has no
bfloat16); on a machine with CUDA the same tests run compiled, on a copy of the fixture model moved
to `DEVICE`.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from reference_fixture import REFERENCE_DIR as FIXTURE

pytest.importorskip("triton")

from stage_ar import gemv as gemv_kernels  # noqa: E402
from stage_ar.linear import (  # noqa: E402
    TORCH_LINEAR, GemvLinear, MammothLinear, TorchLinear, select_backend, set_linear_backend,
)

ATOL = 1e-4  # the fixture's tolerance (test_ar_fidelity)
#: Where the kernels run: CUDA when present (compiled), else the CPU (Triton's interpreter).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _kernel_copy(model):
    """A copy of the (module-scoped, CPU) fixture model on `DEVICE`; skips where triton cannot run."""
    if not gemv_kernels.available(DEVICE):
        pytest.skip("needs CUDA or Triton's interpreter (TRITON_INTERPRET=1)")
    return copy.deepcopy(model).to(DEVICE)


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_file(FIXTURE / "tiny_outputs.safetensors")


#: 128 output columns per program: 8x fewer interpreted programs than serving's 16/32 (a row's
#: bits still do not depend on M: the launch is the same for every M)
TEST_CONFIG = gemv_kernels.GemvConfig(128, 4, 1)


@pytest.fixture
def gemv_model(model):
    kernel_model = _kernel_copy(model)
    set_linear_backend(kernel_model, GemvLinear(TEST_CONFIG, fuse_epilogues=False))  # the plain kernel
    return kernel_model


@pytest.fixture
def launches(monkeypatch):
    """``(rows, epilogue)`` of each real kernel launch (it still runs); epilogue ``"swiglu"``,
    ``"rope"`` or ``""``."""
    calls = []
    real = gemv_kernels.gemv

    def recording(x, *args, **kwargs):
        calls.append((x.shape[0], "swiglu" if kwargs.get("swiglu") else "rope" if kwargs.get("cos") is not None else ""))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(gemv_kernels, "gemv", recording)
    return calls


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the real kernel's launches (it still runs)."""
    calls = []
    real = gemv_kernels.gemv

    def counting(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(gemv_kernels, "gemv", counting)
    return calls


def _decode_all(model, ids: torch.Tensor, prefill: int):
    """Prefill ``prefill`` tokens into a KV cache, then one token per forward, on the model's device;
    logits and rows on the CPU."""
    device = model.lm_head.weight.device
    ids = ids.to(device)
    cache = model.new_kv_cache(1, ids.shape[1])
    with torch.no_grad():
        first = model(ids[:, :prefill], torch.arange(prefill, device=device)[None], kv_cache=cache)
        rows, logits = [first.last_hidden_state], [first.logits]
        for t in range(prefill, ids.shape[1]):
            step = model(ids[:, t : t + 1], torch.tensor([[t]], device=device), kv_cache=cache)
            rows.append(step.last_hidden_state)
            logits.append(step.logits)
    return torch.cat(rows, 1)[0].cpu(), torch.cat(logits, 1)[0].cpu()


def _assert_fixture_and_torch(model, reference, rows, logits) -> None:
    """``rows``/``logits`` of `_decode_all` over the fixture's ids are within the fixture's tolerance,
    and within float32 rounding of the same decode through torch matmul (the model is left on it)."""
    torch.testing.assert_close(logits, reference["ar_logits"], atol=ATOL, rtol=0)
    torch.testing.assert_close(rows, reference["ar_last_hidden_states"], atol=ATOL, rtol=0)
    set_linear_backend(model, TORCH_LINEAR)
    torch_rows, torch_logits = _decode_all(model, reference["ar_input_ids"], 16)
    torch.testing.assert_close(logits, torch_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(rows, torch_rows, atol=1e-5, rtol=0)


def test_gemv_backend_forward_matches_the_reference_fixture(gemv_model, reference, kernel_calls):
    """The fixture's 32 ids (20 text, 12 generation: both experts) through the GEMV kernels: a
    16-token prefill (16 rows) and 16 single-token steps, every projection and both heads in the kernel."""
    rows, logits = _decode_all(gemv_model, reference["ar_input_ids"], 16)
    layers = gemv_model.config.num_hidden_layers
    # prefill: 4 projections per layer per expert group present (text + generation tokens in layers 2, 3), 2 heads
    assert len(kernel_calls) >= 17 * (4 * layers + 2) and max(kernel_calls) <= 16
    _assert_fixture_and_torch(gemv_model, reference, rows, logits)


def test_fused_epilogues_forward_matches_the_fixture_and_the_unfused_forward(gemv_model, reference, launches):
    """``fuse_epilogues``: every layer's qkv launch rotates q and k and its gate/up launch applies
    SwiGLU (one launch each, no eager op after them), in the 16-row prefill and every decode step;
    the result stays within the fixture's tolerance and within float32 rounding of the unfused
    forward (torch matmul, then `stage_ar.layers`' eager ops; the unfused GEMV forward is as close
    to it, the test above)."""
    set_linear_backend(gemv_model, GemvLinear(TEST_CONFIG, fuse_epilogues=True))
    rows, logits = _decode_all(gemv_model, reference["ar_input_ids"], 16)
    layers, forwards = gemv_model.config.num_hidden_layers, 17
    kinds = [epilogue for _, epilogue in launches]
    assert kinds.count("rope") == kinds.count("swiglu") == layers * forwards
    assert max(r for r, _ in launches) == 16
    _assert_fixture_and_torch(gemv_model, reference, rows, logits)


def _decode_together(model, tok, specs: list[int]) -> dict[int, torch.Tensor]:
    """Requests ``specs`` (test_batch_engine's SPECS, all joining at once) through one batched
    `ARModelRunner` step loop as served on CUDA: one generation token per slot, the split-KV Triton
    attention (batch-invariant), projections through the model's linear backend; rows per request."""
    from test_batch_engine import grid_ids, make_seq

    from stage_ar.runner import ARModelRunner

    runner = ARModelRunner(model, 8, 96, **dict(zip(("eol_token_id", "visual_token_start_id", "visual_token_end_id"),
                           grid_ids(tok))), exact_rows=False, fused_attention=True, compile=False)
    rows, first = {}, 0
    for i in specs:
        seq = make_seq(model, tok, i)
        seq.attach_kv_cache(runner.kv_view(first, seq.cache_batch))
        seq.prefill()
        runner.activate(i, seq, first)
        rows[i], first = [], first + seq.cache_batch
    while (pending := runner.launch()) is not None:
        runner.collect(pending)
        for e in pending.entries:
            rows[e.key].append(pending.hidden[e.slot])
    return {i: torch.stack(r) for i, r in rows.items()}


@pytest.mark.slow  # 38 s in the interpreter; the served (fused) path's decode below runs by default
def test_gemv_backend_rows_do_not_depend_on_the_batch(gemv_model, tokenizer):
    """A request decoded inside a batch (bucket 4: 3 rows of 4 in use per projection call) gives the
    bits it gives decoded alone (bucket 2: its two AR-CFG rows): the plain kernel's per-row
    reduction order is fixed, whatever M. The torch backend fails this on CPU (measured 2026-12-01:
    the CPU matmul's order depends on M). The CPU's SDPA is not batch-invariant either, hence the
    runner's Triton attention, as served on CUDA."""
    together = _decode_together(gemv_model, tokenizer, [2, 3])
    alone = _decode_together(gemv_model, tokenizer, [2])[2]
    assert torch.equal(alone, together[2]), "request 2 alone != inside the batch"


def test_fused_epilogues_rows_do_not_depend_on_the_batch(gemv_model, tokenizer, launches):
    """With the default ``fuse_epilogues`` (the served path) a request decoded inside a batch gives
    the bits it gives alone (as `test_gemv_backend_rows_do_not_depend_on_the_batch` for the plain
    kernel, the fused launches in every step)."""
    set_linear_backend(gemv_model, GemvLinear(TEST_CONFIG))
    together = _decode_together(gemv_model, tokenizer, [2, 3])
    assert {"rope", "swiglu"} <= {epilogue for _, epilogue in launches}
    alone = _decode_together(gemv_model, tokenizer, [2])[2]
    assert torch.equal(alone, together[2]), "request 2 alone != inside the batch"


def test_w8a8_rows_do_not_depend_on_the_batch(model, tokenizer):
    """Served with ``weights_dtype: fp8-w8a8`` (FP8 visual-token weights, ``GemvLinear(fp8_compute="fp8")``
    with the default epilogues): a request decoded inside a batch gives the bits it gives alone, since
    each activation row is quantized with its own scale by its own programs."""
    from stage_ar.linear import quantize_fp8_

    w8a8 = _kernel_copy(model)
    quantize_fp8_(w8a8.visual_token_linears())
    set_linear_backend(w8a8, GemvLinear(TEST_CONFIG, fp8_compute="fp8"))
    together = _decode_together(w8a8, tokenizer, [2, 3])
    alone = _decode_together(w8a8, tokenizer, [2])[2]
    assert torch.equal(alone, together[2]), "request 2 alone != inside the batch"


def test_fused_entry_points_fall_back_to_the_given_op_above_16_rows(launches):
    """`MammothLinear.forward_swiglu` / `forward_rope_qkv` with a fusing `GemvLinear`: at most 16 rows
    one fused launch; above, torch matmul then the op passed in (the eager or compiled one), the
    result the same as the unfused path's."""
    if not gemv_kernels.available(DEVICE):
        pytest.skip("needs CUDA or Triton's interpreter (TRITON_INTERPRET=1)")
    from stage_ar.layers import rope_qkv, silu_and_mul

    g = torch.Generator().manual_seed(2)
    gate_up, qkv = MammothLinear(32, 48, bias=False), MammothLinear(32, 64, bias=True)
    with torch.no_grad():
        for layer in (gate_up, qkv):
            for param in layer.parameters():
                param.copy_(torch.randn(param.shape, generator=g) / 4)
    x = torch.randn(2, 12, 32, generator=g)
    angles = torch.arange(24.0).view(2, 12, 1) * torch.tensor([1.0, 0.3, 0.1, 0.03])
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # head_dim 8
    gate_up, qkv, x, cos, sin = (t.to(DEVICE) for t in (gate_up, qkv, x, cos, sin))
    used = []

    def act(y):
        used.append("act")
        return silu_and_mul(y)

    for layer in (gate_up, qkv):
        layer.backend = GemvLinear(TEST_CONFIG, fuse_epilogues=True)
    small, big = gate_up.forward_swiglu(x[:1], act), gate_up.forward_swiglu(x, act)  # 12 rows, 24 rows
    q, k, v = qkv.forward_rope_qkv(x[:1], cos[:1], sin[:1], 4, 2)
    assert launches == [(12, "swiglu"), (12, "rope")] and used == ["act"]  # the 24-row call: torch, then act
    torch.testing.assert_close(big[:1], small, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(small, silu_and_mul(TORCH_LINEAR(x[:1], gate_up.weight, None, None)), atol=1e-5,
                               rtol=1e-5)
    want = rope_qkv(TORCH_LINEAR(x[:1], qkv.weight, qkv.bias, None), cos[:1], sin[:1], 4, 2)
    for got, ref in zip((q, k, v), want):
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    launches.clear()
    for layer in (gate_up, qkv):
        layer.backend = GemvLinear(TEST_CONFIG, fuse_epilogues=["rope"])  # one of the two only
    gate_up.forward_swiglu(x[:1], act), qkv.forward_rope_qkv(x[:1], cos[:1], sin[:1], 4, 2)
    assert launches == [(12, ""), (12, "rope")] and used == ["act", "act"]


def test_more_than_16_rows_go_to_torch_and_fp8_matches_the_kernel(kernel_calls):
    """Calls above 16 rows take `TorchLinear`; an FP8 layer gives the same result through either."""
    if not gemv_kernels.available(DEVICE):
        pytest.skip("needs CUDA or Triton's interpreter (TRITON_INTERPRET=1)")
    g = torch.Generator().manual_seed(1)
    layer = MammothLinear(96, 40, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 96, generator=g) / 10)
        layer.bias.copy_(torch.randn(40, generator=g))
    layer.to(DEVICE).quantize_fp8()
    assert layer.is_fp8 and layer.weight_scale.shape == (40,) and layer.bias.dtype == torch.float32
    x = torch.randn(2, 12, 96, generator=g).to(DEVICE)
    layer.backend = GemvLinear()
    big = layer(x)  # 24 rows
    assert kernel_calls == []
    small = layer(x[:1])  # 12 rows
    assert kernel_calls == [12]
    layer.backend = TorchLinear()
    torch.testing.assert_close(small, layer(x[:1]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(big[:1], small, atol=1e-5, rtol=1e-5)


def test_backend_selection():
    assert select_backend("torch", "cpu") is TORCH_LINEAR
    assert select_backend("auto", "cpu") is TORCH_LINEAR  # CPU serving: torch matmul
    with pytest.raises(ValueError, match="linear backend"):
        select_backend("cutlass", "cpu")
    expected = GemvLinear if gemv_kernels.available(torch.device("cpu")) else TorchLinear
    assert isinstance(select_backend("gemv", "cpu"), expected)
    # rope and swiglu on by default (faster on the H200, docs/PERFORMANCE.md), the W8A8 amax fold
    # opt-in (slower on the H100); True turns all on, False all off
    assert GemvLinear().fuse_epilogues == {"rope", "swiglu"} and not GemvLinear(fuse_epilogues=False).fuse_epilogues
    assert GemvLinear(fuse_epilogues=True).fuse_epilogues == {"rope", "swiglu", "amax"}
    if expected is GemvLinear:
        assert select_backend("gemv", "cpu").fuse_epilogues == {"rope", "swiglu"}
        assert not select_backend("gemv", "cpu", fuse_epilogues=False).fuse_epilogues
    with pytest.raises(ValueError, match="fuse_epilogues"):
        GemvLinear(fuse_epilogues=["norm"])


def test_w8a8_layer_folds_its_norms_and_the_mlp_quantizer_with_the_same_bits(model, reference, monkeypatch):
    """Under W8A8 (``GemvLinear(fp8_compute="fp8")``, FP8 visual-token weights) a layer's residual add
    + RMSNorm before an FP8 projection runs inside the quantizer's launch (`stage_ar.linear.norm_input`:
    `quantize_rows` with ``residual=``, the rows handed on as `QuantizedRows`), not as a norm kernel
    of its own, and the MLP's ``down_proj`` quantizes the SwiGLU output in its own prologue
    (`LinearBackend.mlp`: `RowsWithAmax`), not in a quantizer launch; norms before bf16 projections
    (the understanding experts) and the final norm keep the module's kernels. The fixture's first 21
    ids (a 16-row prefill of text, then 4 text tokens and a generation token one by one) give the same
    logits and rows, bit for bit, as the unfused chain (the norm launch, then the quantizer; the
    quantizer before ``down_proj``) with the norms in the same summation order (`rms_norm_rows`)."""
    from stage_ar import linear
    from stage_ar.layers import PointwiseOps
    from stage_ar.linear import LinearBackend, quantize_fp8_

    w8a8 = _kernel_copy(model)
    quantize_fp8_(w8a8.visual_token_linears())
    set_linear_backend(w8a8, GemvLinear(TEST_CONFIG, fp8_compute="fp8", fuse_epilogues=True))
    norms = []

    def rows_norm(x, w, eps):
        norms.append(x.shape)
        return gemv_kernels.rms_norm_rows(x.reshape(-1, x.shape[-1]).contiguous(), w, eps).view(x.shape)

    def rows_add_norm(x, r, w, eps):
        summed = r + x
        return rows_norm(summed, w, eps), summed

    ops = PointwiseOps(rms_norm=rows_norm, add_rms_norm=rows_add_norm)
    fused, quantized = [], []

    def recording(calls, real):
        def record(x, *args, **kwargs):
            calls.append(kwargs.get("residual") is not None)
            return real(x, *args, **kwargs)
        return record

    def decode(ids, prefill=16):
        cache = w8a8.new_kv_cache(1, ids.shape[1])
        with torch.no_grad():
            outs = [w8a8(ids[:, :prefill], torch.arange(prefill, device=DEVICE)[None], kv_cache=cache, ops=ops)]
            outs += [w8a8(ids[:, t : t + 1], torch.tensor([[t]], device=DEVICE), kv_cache=cache, ops=ops)
                     for t in range(prefill, ids.shape[1])]
        return torch.cat([o.last_hidden_state for o in outs], 1), torch.cat([o.logits for o in outs], 1)

    ids = reference["ar_input_ids"][:, :21].to(DEVICE)
    monkeypatch.setattr(linear, "quantize_rows", recording(fused, linear.quantize_rows))
    monkeypatch.setattr(gemv_kernels, "quantize_rows", recording(quantized, gemv_kernels.quantize_rows))
    rows, logits = decode(ids)
    fused_norms, fused_calls, gemv_quantized = len(norms), list(fused), len(quantized)
    forwards = 1 + ids.shape[1] - 16
    layers = w8a8.config.num_hidden_layers
    assert fused_calls.count(True) >= forwards  # the add + norm before FP8 projections, in the quantizer
    assert len(fused_calls) + fused_norms == forwards * (2 * layers + 1)  # every pre-norm one way or the other
    norms.clear(), quantized.clear()
    monkeypatch.setattr(GemvLinear, "norm_input", LinearBackend.norm_input)  # the unfused chain
    monkeypatch.setattr(GemvLinear, "mlp", LinearBackend.mlp)
    want_rows, want_logits = decode(ids)
    assert len(norms) == forwards * (2 * layers + 1)
    assert len(quantized) >= gemv_quantized + len(fused_calls) + forwards  # + every down_proj's quantizer
    assert torch.equal(rows, want_rows) and torch.equal(logits, want_logits)


def test_w8a8_served_step_quantizes_o_and_down_inputs_in_their_gemvs(model, tokenizer, monkeypatch):
    """In the served decode step (`ARModelRunner.launch`, the split-KV Triton attention) under W8A8,
    every layer's ``o_proj`` and ``down_proj`` take `RowsWithAmax` (the attention's combine and the
    SwiGLU GEMV gathered the rows' amax; the GEMV quantizes in its prologue: no quantizer launch),
    and the decoded rows are bit for bit those of the same steps with those two quantizer launches
    run apart."""
    from stage_ar.fp8_activations import RowsWithAmax
    from stage_ar.linear import LinearBackend, quantize_fp8_
    from stage_ar.runner import ARModelRunner

    w8a8 = _kernel_copy(model)
    quantize_fp8_(w8a8.visual_token_linears())
    set_linear_backend(w8a8, GemvLinear(TEST_CONFIG, fp8_compute="fp8", fuse_epilogues=True))
    calls, in_step = [], []
    real_gemv, real_launch = gemv_kernels.gemv, ARModelRunner.launch

    def recording(x, *args, **kwargs):
        if in_step:
            calls.append("amax_in" if isinstance(x, RowsWithAmax) else "swiglu" if kwargs.get("swiglu") else "")
        return real_gemv(x, *args, **kwargs)

    def step(self, *args, **kwargs):
        in_step.append(True)
        try:
            return real_launch(self, *args, **kwargs)
        finally:
            in_step.clear()

    monkeypatch.setattr(gemv_kernels, "gemv", recording)
    monkeypatch.setattr(ARModelRunner, "launch", step)
    fused = _decode_together(w8a8, tokenizer, [2])[2]
    layers = calls.count("swiglu")
    assert layers and calls.count("amax_in") == 2 * layers  # o_proj and down_proj of every layer of every step
    calls.clear()
    monkeypatch.setattr(GemvLinear, "input_amax", LinearBackend.input_amax)  # the quantizer launches apart
    apart = _decode_together(w8a8, tokenizer, [2])[2]
    assert calls.count("amax_in") == 0 and calls.count("swiglu") == layers
    assert torch.equal(fused, apart)


def test_w8a8_delayed_scales_run_no_quantizer_between_a_layers_gemvs_and_match_per_row_w8a8(model, reference,
                                                                                            monkeypatch):
    """The delayed-scale experiment through the layer seams (``fuse_epilogues`` ``"delayed"``): in a
    generation token's decode step, o_proj writes gate_up's codes with the post-attention norm's
    weight, the SwiGLU GEMV writes down_proj's, down_proj writes the next layer's qkv codes with its
    input norm's weight, and each layer's qkv GEMV rolls the layer's state, so the step's only
    quantizer launches are the first layer's input norm and the attention outputs (o_proj's input):
    1 + 4 against 4 per layer. Its first step saturates (the state holds no amax yet); once the state
    holds the amax of the same step (the step run again on copies of the cache until the gathered amax
    stops changing), the step's logits are within 2 % of per-row W8A8's own distance from the
    unquantized model's (on the fixture: 1.6e-5 against 0.43), which the saturated first
    step (2.78) is not."""
    from stage_ar import linear
    from stage_ar.fp8_activations import delayed_state
    from stage_ar.linear import quantize_fp8_

    ids = reference["ar_input_ids"][:, :21].to(DEVICE)
    assert ids[0, 20] >= model.config.gen_vocab_start_index  # a generation token: every projection FP8

    def build(epilogues):
        m = _kernel_copy(model)
        if epilogues is not None:
            quantize_fp8_(m.visual_token_linears())
        set_linear_backend(m, GemvLinear(TEST_CONFIG, fp8_compute="fp8" if epilogues else None,
                                         fuse_epilogues=epilogues or ("rope", "swiglu")))
        return m

    def prefill(m):
        cache = m.new_kv_cache(1, 21)
        with torch.no_grad():  # 20 rows: above the GEMV's 16, so the prefill runs no delayed launch
            m(ids[:, :20], torch.arange(20, device=DEVICE)[None], kv_cache=cache)
        return cache

    def step(m, cache):
        with torch.no_grad():
            return m(ids[:, 20:21], torch.tensor([[20]], device=DEVICE), kv_cache=cache).logits[0, -1].float()

    unquantized, per_row = build(None), build(("rope", "swiglu"))
    want, per_row_logits = step(unquantized, prefill(unquantized)), step(per_row, prefill(per_row))
    delayed = build(("rope", "swiglu", "delayed"))
    states = [delayed_state(layer.self_attn.input_projection(delayed._routing(ids[:, 20:21])).weight)
              for layer in delayed.model.language_model.layers]
    for state in states:
        state.zero_()  # persistent buffers: another test's freed weights may have had these addresses
    cache = prefill(delayed)
    calls = []
    real = gemv_kernels.quantize_rows
    monkeypatch.setattr(gemv_kernels, "quantize_rows", lambda *a, **k: calls.append("gemv") or real(*a, **k))
    monkeypatch.setattr(linear, "quantize_rows", lambda *a, **k: calls.append("norm") or real(*a, **k))
    first = step(delayed, copy.deepcopy(cache))
    layers = delayed.config.num_hidden_layers
    assert calls.count("norm") == 1 and calls.count("gemv") == layers, calls
    for _ in range(4 * layers):  # each run makes at least one more point's amax that of the true rows
        gathered = [s.view(4, 2, 16)[:, 1].clone() for s in states]
        step(delayed, copy.deepcopy(cache))
        if all(torch.equal(g, s.view(4, 2, 16)[:, 1]) for g, s in zip(gathered, states)):
            break
    else:
        pytest.fail("the delayed amax never settled")
    got = step(delayed, cache)
    bound = (per_row_logits - want).abs().max()
    assert (got - per_row_logits).abs().max() <= 0.02 * bound, ((got - per_row_logits).abs().max(), bound)
    assert (first - per_row_logits).abs().max() > 0.02 * bound  # the saturated first step fails it


def test_w8a8_delayed_served_step_runs_one_quantizer_launch(model, tokenizer, monkeypatch):
    """In the served decode step (`ARModelRunner.launch`, the split-KV Triton attention) under the
    delayed-scale experiment, the attention's combine writes o_proj's codes too: every layer's o_proj,
    gate_up and down, and every qkv but the first layer's, read `DelayedRows`, and the step's one
    quantizer launch is the first layer's input norm (4 per layer before)."""
    from stage_ar import linear
    from stage_ar.fp8_activations import DelayedRows
    from stage_ar.linear import quantize_fp8_
    from stage_ar.runner import ARModelRunner

    w8a8 = _kernel_copy(model)
    quantize_fp8_(w8a8.visual_token_linears())
    set_linear_backend(w8a8, GemvLinear(TEST_CONFIG, fp8_compute="fp8", fuse_epilogues=("rope", "swiglu", "delayed")))
    calls, in_step = [], []
    real_gemv, real_quantize, real_launch = gemv_kernels.gemv, linear.quantize_rows, ARModelRunner.launch

    def recording(x, *args, **kwargs):
        if in_step:
            calls.append("delayed" if isinstance(x, DelayedRows) else "swiglu" if kwargs.get("swiglu") else "")
        return real_gemv(x, *args, **kwargs)

    def quantizing(*args, **kwargs):
        if in_step:
            calls.append("quantize")
        return real_quantize(*args, **kwargs)

    def step(self, *args, **kwargs):
        in_step.append(True)
        try:
            return real_launch(self, *args, **kwargs)
        finally:
            in_step.clear()

    monkeypatch.setattr(gemv_kernels, "gemv", recording)
    monkeypatch.setattr(gemv_kernels, "quantize_rows", quantizing)
    monkeypatch.setattr(linear, "quantize_rows", quantizing)
    monkeypatch.setattr(ARModelRunner, "launch", step)
    _decode_together(w8a8, tokenizer, [2])
    steps = calls.count("quantize")
    layers = w8a8.config.num_hidden_layers
    assert steps and calls.count("delayed") == steps * (4 * layers - 1), calls[:40]
