"""FP8 (E4M3, per-output-channel scales) AR weights: numerics on the upstream reference fixture, which
weights convert, and the load path (``weights_dtype="fp8"``, ``mammoth ar --weights-dtype fp8``).

Deviation measured on the fixture (CPU, 2026-12-01; the fixture's tiny random model, hidden 64, so
each output sums only 64 to 128 rounded weights: a pessimistic case), max abs over the 32 positions
(logits |max| 4.0, last hidden |max| 3.35), and the relative L2 error of the last hidden state:

| model vs the fp32 reference | logits | last hidden | all hidden | relative |
| --- | ---: | ---: | ---: | ---: |
| bf16 weights and activations | 0.101 | 0.089 | 0.089 | 0.016 |
| FP8 weights, fp32 activations | 0.472 | 0.643 | 0.643 | 0.099 |
| FP8 weights, bf16 activations | 0.608 | 0.499 | 0.661 | 0.103 |

The thresholds below are these numbers with about 25 % headroom (docs/PERFORMANCE.md, FP8 weights).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from reference_fixture import REFERENCE_DIR as FIXTURE
from stage_ar.linear import MammothLinear, quantize_fp8_
from stage_ar.modeling_mammoth_ar import MammothARForCausalLM, strip_llm_prefix

#: (activation dtype, FP8 weights) -> max abs error bounds (logits, last hidden, all hidden, relative L2)
BOUNDS = {
    (torch.bfloat16, False): (0.13, 0.12, 0.12, 0.02),
    (torch.float32, True): (0.6, 0.8, 0.8, 0.125),
    (torch.bfloat16, True): (0.76, 0.63, 0.83, 0.13),
}


def _model(dtype: torch.dtype, fp8: bool) -> MammothARForCausalLM:
    cfg = json.loads((FIXTURE / "tiny_config_save_pretrained.json").read_text())["llm_config"]
    m = MammothARForCausalLM.from_llm_config(cfg)
    m.load_state_dict(strip_llm_prefix(load_file(FIXTURE / "tiny_reference.safetensors")), strict=True)
    m.eval().to(dtype)
    if fp8:
        quantize_fp8_(m.visual_token_linears())
    return m


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_file(FIXTURE / "tiny_outputs.safetensors")


@pytest.mark.parametrize(("dtype", "fp8"), list(BOUNDS), ids=["bf16", "fp8-fp32act", "fp8-bf16act"])
def test_deviation_from_the_fp32_reference_is_within_the_recorded_bounds(reference, dtype, fp8):
    ids = reference["ar_input_ids"]
    with torch.no_grad():
        out = _model(dtype, fp8)(ids, torch.arange(ids.shape[1])[None], output_hidden_states=True)
    logits, last = out.logits[0].float(), out.last_hidden_state[0].float()
    every = torch.stack(out.all_hidden_states)[:, 0].float()
    errors = (
        (logits - reference["ar_logits"]).abs().max().item(),
        (last - reference["ar_last_hidden_states"]).abs().max().item(),
        (every - reference["ar_hidden_states_all"]).abs().max().item(),
        ((last - reference["ar_last_hidden_states"]).norm() / reference["ar_last_hidden_states"].norm()).item(),
    )
    bounds = BOUNDS[(dtype, fp8)]
    assert all(e <= b for e, b in zip(errors, bounds)), f"errors {errors} over bounds {bounds}"
    if fp8:  # the conversion really changed the numbers (more than bf16 rounding does)
        assert errors[3] > BOUNDS[(torch.bfloat16, False)][3]


def test_only_the_visual_token_path_converts():
    """Expert layers (2, 3): the generation experts convert, the text experts stay; other layers
    convert their shared projections; embeddings, norms and heads stay in the model dtype."""
    m = _model(torch.float32, True)
    fp8 = {name for name, mod in m.named_modules() if isinstance(mod, MammothLinear) and mod.is_fp8}
    layer = "model.language_model.layers"
    want = set()
    for i in range(4):
        prefix = f"{layer}.{i}.self_attn.gen_" if i >= 2 else f"{layer}.{i}.self_attn."
        mlp = f"{layer}.{i}.gen_mlp" if i >= 2 else f"{layer}.{i}.mlp"
        want |= {prefix + "qkv_proj", prefix + "o_proj", mlp + ".gate_up_proj", mlp + ".down_proj"}
    assert fp8 == want
    state = m.state_dict()
    assert state[f"{layer}.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn  # checkpoint names still
    assert state[f"{layer}.2.self_attn.q_proj.weight"].dtype == torch.float32
    # the row scales under checkpoint names too, one per stacked part (what an FP8 checkpoint stores)
    assert f"{layer}.0.self_attn.qkv_proj.weight_scale" not in state
    assert [state[f"{layer}.0.self_attn.{p}_proj.weight_scale"].shape for p in "qkv"] == [(64,), (32,), (32,)]
    assert state[f"{layer}.0.mlp.gate_proj.weight_scale"].shape == state[f"{layer}.0.mlp.up_proj.weight_scale"].shape
    assert m.lm_head.weight.dtype == m.gen_head.weight.dtype == torch.float32


def test_load_ar_with_fp8_weights_decodes(tiny_checkpoint, tmp_path):
    """``load_ar(..., weights_dtype="fp8")`` converts at load, and the engine decodes a request with it."""
    from stage_ar.engine import CollectingSink, DecodeEngine, DecodeJob, Role
    from stage_ar.loader import load_ar

    bundle = load_ar(str(tiny_checkpoint), str(tmp_path), "cpu", torch.float32, weights_dtype="fp8")
    assert all(lin.is_fp8 for lin in bundle.model.visual_token_linears())
    engine = DecodeEngine(bundle.new_sequence, 2, model=bundle.model, grid_ids=bundle.grid_ids,
                          max_sequence_length=256)
    sink = CollectingSink()
    prompt = bundle.tokenizer.encode_t2i_prompt("a red house", 3, 2)
    engine.run_job(DecodeJob("fp8", 0, prompt, None, 3, 2, 7, 1.0, 0, 0.0, 0.0, sink, lambda a, b: None,
                             lambda exc, stats: None))
    ids = sink.token_ids[Role.CONDITION][len(prompt):]
    assert sink.finished and len(ids) == 2 * 4
    with pytest.raises(ValueError, match="weights_dtype"):
        load_ar(str(tiny_checkpoint), str(tmp_path), "cpu", torch.float32, weights_dtype="int4")


def test_fp8_w8a8_is_refused_before_loading_where_no_gemv_backend_runs(tmp_path):
    """``weights_dtype="fp8-w8a8"`` quantizes activations inside the GEMV kernels only: with the torch
    backend (chosen, or ``auto`` on a CPU) the load stops with an error naming the backend and the
    ``fp8`` alternative, before the checkpoint is even resolved (the path here does not exist)."""
    from stage_ar.loader import load_ar

    for backend in ("torch", "auto"):
        with pytest.raises(ValueError, match=r"fp8-w8a8.*gemv linear backend.*'torch'.*Use 'fp8'"):
            load_ar(str(tmp_path / "absent"), str(tmp_path), "cpu", torch.float32, weights_dtype="fp8-w8a8",
                    linear_backend=backend)


def test_load_ar_with_fp8_w8a8_quantizes_the_activations_of_a_decode_step(tiny_checkpoint, tmp_path, monkeypatch):
    """``weights_dtype="fp8-w8a8"`` with the GEMV backend (Triton's interpreter here): the visual-token
    weights are E4M3, the backend multiplies with ``fp8_compute="fp8"``, and a one-token decode step
    of a generation token quantizes the rows its FP8 projections read (`quantize_rows`, every layer's
    two pre-norms). The served step's rows: `test_ar_linear.test_w8a8_rows_do_not_depend_on_the_batch`."""
    from stage_ar import linear
    from stage_ar.gemv import available
    from stage_ar.loader import load_ar

    if not available(torch.device("cpu")):
        pytest.skip("the GEMV kernels need triton (Triton's interpreter on a CPU)")
    bundle = load_ar(str(tiny_checkpoint), str(tmp_path), "cpu", torch.float32, weights_dtype="fp8-w8a8",
                     linear_backend="gemv")
    model = bundle.model
    assert all(lin.is_fp8 for lin in model.visual_token_linears())
    assert model.linear_backend.fp8_compute == "fp8"
    quantized = []
    real = linear.quantize_rows

    def counting(*args, **kwargs):
        quantized.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(linear, "quantize_rows", counting)
    cache = model.new_kv_cache(1, 8)
    ids = torch.tensor([[bundle.grid_ids[1]]])  # the first visual code: a generation token
    with torch.no_grad():
        out = model(ids, torch.zeros_like(ids), kv_cache=cache)
    assert torch.isfinite(out.logits).all()
    assert quantized == [1] * (2 * model.config.num_hidden_layers)


def test_the_flag_reaches_the_settings():
    from mammoth_app.cli import build_parser
    from mammoth_core.settings import ARSettings, SettingsError, resolve_settings

    args = build_parser().parse_args(["ar", "--weights-dtype", "fp8", "--linear-backend", "torch"])
    assert (args.weights_dtype, args.linear_backend) == ("fp8", "torch")
    assert build_parser().parse_args(["ar", "--weights-dtype", "fp8-w8a8"]).weights_dtype == "fp8-w8a8"
    with pytest.raises((SettingsError, SystemExit)):
        build_parser().parse_args(["ar", "--weights-dtype", "int8"])
    assert ARSettings().weights_dtype == "auto"
    with pytest.raises(SettingsError, match="weights_dtype"):
        resolve_settings(ARSettings, env={"MAMMOTH_WEIGHTS_DTYPE": "int8"})
    assert resolve_settings(ARSettings, env={"MAMMOTH_WEIGHTS_DTYPE": "fp8-w8a8"}).weights_dtype == "fp8-w8a8"
    with pytest.raises(SettingsError, match="fp8-w8a8 is not supported with tensor_parallel_size"):
        resolve_settings(ARSettings, env={"MAMMOTH_WEIGHTS_DTYPE": "fp8-w8a8", "MAMMOTH_TENSOR_PARALLEL_SIZE": "2"})
