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


def _served_steps(monkeypatch) -> list:
    """A list that is non-empty exactly while `ARModelRunner.launch` runs (a served step), for recorders."""
    from stage_ar.runner import ARModelRunner

    in_step, real_launch = [], ARModelRunner.launch

    def step(self, *args, **kwargs):
        in_step.append(True)
        try:
            return real_launch(self, *args, **kwargs)
        finally:
            in_step.clear()

    monkeypatch.setattr(ARModelRunner, "launch", step)
    return in_step


def test_w8a8_served_step_quantizes_o_and_down_inputs_in_their_gemvs(model, tokenizer, monkeypatch):
    """In the served decode step (`ARModelRunner.launch`, the split-KV Triton attention) under W8A8,
    every layer's ``o_proj`` and ``down_proj`` take `RowsWithAmax` (the attention's combine and the
    SwiGLU GEMV gathered the rows' amax; the GEMV quantizes in its prologue: no quantizer launch),
    and the decoded rows are bit for bit those of the same steps with those two quantizer launches
    run apart."""
    from stage_ar.fp8_activations import RowsWithAmax
    from stage_ar.linear import LinearBackend, quantize_fp8_

    w8a8 = _kernel_copy(model)
    quantize_fp8_(w8a8.visual_token_linears())
    set_linear_backend(w8a8, GemvLinear(TEST_CONFIG, fp8_compute="fp8", fuse_epilogues=True))
    calls, in_step = [], _served_steps(monkeypatch)
    real_gemv = gemv_kernels.gemv

    def recording(x, *args, **kwargs):
        if in_step:
            calls.append("amax_in" if isinstance(x, RowsWithAmax) else "swiglu" if kwargs.get("swiglu") else "")
        return real_gemv(x, *args, **kwargs)

    monkeypatch.setattr(gemv_kernels, "gemv", recording)
    fused = _decode_together(w8a8, tokenizer, [2])[2]
    layers = calls.count("swiglu")
    assert layers and calls.count("amax_in") == 2 * layers  # o_proj and down_proj of every layer of every step
    calls.clear()
    monkeypatch.setattr(GemvLinear, "input_amax", LinearBackend.input_amax)  # the quantizer launches apart
    apart = _decode_together(w8a8, tokenizer, [2])[2]
    assert calls.count("amax_in") == 0 and calls.count("swiglu") == layers
    assert torch.equal(fused, apart)


def test_w8a8_delayed_scales_touch_nothing_outside_a_slot_decode_step(model, reference):
    """Delayed activation scales keep per-row state across steps, indexed by the rows of a decode step
    whose rows are pool slots (`stage_ar.modeling_mammoth_ar.rows_are_slots`). Any other forward (a
    prefill of up to 16 rows, the B=1 reference path with SDPA) must neither read nor advance it: under
    ``"delayed"`` such a forward gives per-row W8A8's bits and leaves every layer's state as it was."""
    from stage_ar.fp8_activations import delayed_state
    from stage_ar.linear import quantize_fp8_

    ids = reference["ar_input_ids"][:, :21].to(DEVICE)

    def decode(epilogues):
        m = _kernel_copy(model)
        quantize_fp8_(m.visual_token_linears())
        set_linear_backend(m, GemvLinear(TEST_CONFIG, fp8_compute="fp8", fuse_epilogues=epilogues))
        states = [delayed_state(layer.self_attn.input_projection(m._routing(ids[:, 20:21])).weight).clone()
                  for layer in m.model.language_model.layers]
        cache = m.new_kv_cache(1, 21)
        with torch.no_grad():  # a 16-row prefill (GEMV launches), then single rows
            outs = [m(ids[:, :16], torch.arange(16, device=DEVICE)[None], kv_cache=cache)]
            outs += [m(ids[:, t:t + 1], torch.tensor([[t]], device=DEVICE), kv_cache=cache) for t in range(16, 21)]
        after = [delayed_state(layer.self_attn.input_projection(m._routing(ids[:, 20:21])).weight)
                 for layer in m.model.language_model.layers]
        assert all(torch.equal(x, y) for x, y in zip(states, after))
        return torch.cat([o.logits for o in outs], 1)

    assert torch.equal(decode(("rope", "swiglu", "delayed")), decode(("rope", "swiglu")))


def test_w8a8_delayed_served_step_runs_one_quantizer_launch(model, tokenizer, monkeypatch):
    """In the served decode step (`ARModelRunner.launch`, the split-KV Triton attention) under the
    delayed-scale experiment, the attention's combine writes o_proj's codes too: every layer's o_proj,
    gate_up and down, and every qkv but the first layer's, read `DelayedRows`, and the step's one
    quantizer launch is the first layer's input norm (4 per layer before). The request's first step
    (its rows fresh: `stage_ar.fp8_activations.mark_fresh` at activation) gives per-row W8A8's bits;
    its later steps are as close to the same weights with unquantized activations as per-row W8A8's. The
    same request decoded again in the slots it just left gives the same bits (no amax of the slot's
    previous request)."""
    from stage_ar import linear
    from stage_ar.fp8_activations import DelayedRows
    from stage_ar.linear import quantize_fp8_

    w8a8 = _kernel_copy(model)
    quantize_fp8_(w8a8.visual_token_linears())
    set_linear_backend(w8a8, GemvLinear(TEST_CONFIG, fp8_compute="fp8", fuse_epilogues=("rope", "swiglu", "delayed")))
    calls, in_step = [], _served_steps(monkeypatch)
    real_gemv, real_quantize = gemv_kernels.gemv, linear.quantize_rows

    def recording(x, *args, **kwargs):
        if in_step:
            calls.append("delayed" if isinstance(x, DelayedRows) else "swiglu" if kwargs.get("swiglu") else "")
        return real_gemv(x, *args, **kwargs)

    def quantizing(*args, **kwargs):
        if in_step:
            calls.append("quantize")
        return real_quantize(*args, **kwargs)

    monkeypatch.setattr(gemv_kernels, "gemv", recording)
    monkeypatch.setattr(gemv_kernels, "quantize_rows", quantizing)
    monkeypatch.setattr(linear, "quantize_rows", quantizing)
    rows = _decode_together(w8a8, tokenizer, [2])[2]
    steps = calls.count("quantize")
    layers = w8a8.config.num_hidden_layers
    assert steps and calls.count("delayed") == steps * (4 * layers - 1), calls[:40]
    monkeypatch.undo()
    assert torch.equal(_decode_together(w8a8, tokenizer, [2])[2], rows)  # again, in slots a request just left
    per_row = _kernel_copy(model)  # the same request under per-row W8A8, and unquantized
    quantize_fp8_(per_row.visual_token_linears())
    set_linear_backend(per_row, GemvLinear(TEST_CONFIG, fp8_compute="fp8"))
    unquantized = _kernel_copy(model)  # the FP8 weights, activations as they are (W8A16)
    quantize_fp8_(unquantized.visual_token_linears())
    set_linear_backend(unquantized, GemvLinear(TEST_CONFIG))
    want, exact = _decode_together(per_row, tokenizer, [2])[2], _decode_together(unquantized, tokenizer, [2])[2]
    assert torch.equal(rows[0], want[0])  # the first step: fresh rows get per-row W8A8's codes and scales
    # later steps: other roundings than per-row W8A8's, as far from the unquantized activations (FP8
    # weights alone); on the fixture 0.17-0.25 against 0.14-0.28 (rows of magnitude 2-3)
    assert (rows.float() - exact.float()).abs().max() <= 1.25 * (want.float() - exact.float()).abs().max()
