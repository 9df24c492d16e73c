"""DiT-side model code against the upstream reference fixture (float32, CPU, max-abs 1e-4)."""

from __future__ import annotations

import json

import pytest
import torch
from dit_reference import FIXTURE_DIR, config, load_strict, max_abs, outputs, pipeline, weights

from stage_dit.pipeline import build_dit_modules

TOL = 1e-4


def batched_velocity(pipe, latents, t, conditions):
    """One transformer forward over ``conditions`` (right-padded and masked, as the worker loop
    batches CFG branches); one float32 velocity per condition."""
    from stage_dit.denoise import pad_conditions

    text, mask = pad_conditions([c.to(pipe.device, pipe.dtype) for c in conditions])
    n = len(conditions)
    v = pipe.transformer(latents.expand(n, -1, -1, -1), t.reshape(1).expand(n).float(), text, mask)
    return [v[i : i + 1].float() for i in range(n)]


@pytest.fixture(scope="module")
def pipe():
    torch.manual_seed(0)
    return pipeline()


@pytest.fixture(scope="module")
def out():
    return outputs()


def velocity(pipe, condition: torch.Tensor, out) -> torch.Tensor:
    with torch.inference_mode():
        return pipe.transformer(
            out["dit_latents"],
            out["dit_timestep"],
            condition[None],
            torch.ones(1, condition.shape[0], dtype=torch.bool),
        )


def test_weights_load_with_no_missing_or_unexpected_keys():
    modules = build_dit_modules(config())
    report = load_strict(modules)
    assert set(report) == {"gen_transformer", "gen_image_condition_refiner", "gen_vae"}
    for prefix, (missing, unexpected) in report.items():
        assert missing == [] and unexpected == [], prefix
    # every gen_* tensor of the checkpoint is consumed, with the shapes of tiny_keys.json
    shapes = json.loads((FIXTURE_DIR / "tiny_keys.json").read_text())
    ours = {
        f"{prefix}.{k}": list(v.shape)
        for prefix, module in modules.named_modules_by_prefix().items()
        for k, v in module.state_dict().items()
    }
    prefixes = ("gen_transformer.", "gen_image_condition_refiner.", "gen_vae.")
    theirs = {k: v for k, v in shapes.items() if k.startswith(prefixes)}
    assert ours == theirs


def test_meta_device_build_has_checkpoint_shapes():
    modules = build_dit_modules(config(), device="meta")
    for prefix, module in modules.named_modules_by_prefix().items():
        for name, tensor in module.state_dict().items():
            assert tensor.is_meta
            assert tuple(tensor.shape) == tuple(weights()[f"{prefix}.{name}"].shape)


def test_time_embedding(pipe, out):
    with torch.inference_mode():
        temb, caption = pipe.transformer.time_caption_embed(
            out["dit_timestep"], out["condition_tokens_text_image"][None]
        )
    assert max_abs(temb, out["dit_temb"]) < TOL
    assert max_abs(caption, out["dit_caption_embed_text_image"]) < TOL


@pytest.mark.parametrize(
    ("condition", "expected"),
    [
        ("condition_tokens_text_image", "dit_velocity_text_image"),
        ("condition_tokens_image", "dit_velocity_image"),
        ("neg_condition_tokens", "dit_velocity_negative"),
    ],
)
def test_velocity(pipe, out, condition, expected):
    assert max_abs(velocity(pipe, out[condition], out), out[expected]) < TOL


def test_refiner(pipe, out):
    with torch.inference_mode():
        refined = pipe.refiner(out["cond_image_rows_raw"][None], torch.zeros(1, 10, dtype=torch.bool))[0]
    assert max_abs(refined, out["cond_image_rows_refined"]) < TOL


def test_vae_decode(pipe, out):
    with torch.inference_mode():
        decoded = pipe.vae.decode(out["vae_latent"], return_dict=False)[0]
    assert max_abs(decoded, out["vae_decoded"]) < TOL


def test_guided_loop_end_to_end(pipe, out):
    latents = pipe.prepare_latents(width=64, height=64, seed=21)
    assert torch.equal(latents, out["e2e_init_latents"])
    final = pipe.denoise(
        latents,
        out["condition_tokens_text_image"],
        out["neg_condition_tokens"],
        num_inference_steps=8,
        text_guidance_scale=4.0,
        cfg_range=(0.0, 1.0),
    )
    assert max_abs(pipe.decode_latents(final, clamp=False), out["e2e_image"][0]) < TOL


def test_cfg_batched_forward_equals_separate_forwards(pipe, out):
    cond, neg = out["condition_tokens_text_image"], out["neg_condition_tokens"]  # 26 and 12 rows
    t = out["dit_timestep"][0]
    with torch.inference_mode():
        v_cond, v_neg = batched_velocity(pipe, out["dit_latents"], t, [cond, neg])
    assert max_abs(v_cond, out["dit_velocity_text_image"]) < TOL
    assert max_abs(v_neg, out["dit_velocity_negative"]) < TOL


def test_padded_batch_equals_unpadded_single_runs(pipe, out):
    short = out["condition_tokens_image"]  # 8 rows
    long = out["condition_tokens_text_image"]  # 26 rows
    latents = torch.cat([out["dit_latents"], torch.randn(1, 16, 32, 32, generator=torch.Generator().manual_seed(3))])
    text = torch.zeros(2, 26, 64)
    text[0, :8] = short
    text[0, 8:] = 1e3  # garbage in the padding must not leak into real rows
    text[1] = long
    mask = torch.zeros(2, 26, dtype=torch.bool)
    mask[0, :8] = True
    mask[1] = True
    t = torch.tensor([0.3, 0.7])
    with torch.inference_mode():
        batched = pipe.transformer(latents, t, text, mask)
        single0 = pipe.transformer(latents[:1], t[:1], short[None], torch.ones(1, 8, dtype=torch.bool))
        single1 = pipe.transformer(latents[1:], t[1:], long[None], torch.ones(1, 26, dtype=torch.bool))
    assert max_abs(batched[:1], single0) < 1e-5
    assert max_abs(batched[1:], single1) < 1e-5


def test_zero_length_condition_is_finite_and_batches(pipe, out):
    empty = torch.zeros(0, 64)
    t = out["dit_timestep"][0]
    with torch.inference_mode():
        (v_alone,) = batched_velocity(pipe, out["dit_latents"], t, [empty])
        v_cond, v_empty = batched_velocity(pipe, out["dit_latents"], t, [out["condition_tokens_image"], empty])
    assert torch.isfinite(v_alone).all()
    assert max_abs(v_empty, v_alone) < 1e-5
    assert max_abs(v_cond, out["dit_velocity_image"]) < TOL


def test_bfloat16_runs_through_the_same_code(out):
    pipe = pipeline(dtype=torch.bfloat16)
    assert pipe.transformer.x_embedder.weight.dtype == torch.bfloat16
    final = pipe.denoise(
        out["e2e_init_latents"],
        out["condition_tokens_text_image"],
        out["neg_condition_tokens"],
        num_inference_steps=8,
        text_guidance_scale=4.0,
    )
    image = pipe.decode_latents(final, clamp=False)
    assert image.dtype == torch.float32
    # bf16 rounding only: far from the float32 reference's scale (absmax ~3), close to it elementwise
    assert max_abs(image, out["e2e_image"][0]) < 0.25


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_reference(out):
    pipe = pipeline(device="cuda")
    final = pipe.denoise(
        out["e2e_init_latents"].cuda(),
        out["condition_tokens_text_image"].cuda(),
        out["neg_condition_tokens"].cuda(),
        num_inference_steps=8,
        text_guidance_scale=4.0,
    )
    assert max_abs(pipe.decode_latents(final, clamp=False), out["e2e_image"][0]) < 1e-3
    pipe_bf16 = pipeline(dtype=torch.bfloat16, device="cuda")
    final = pipe_bf16.denoise(
        out["e2e_init_latents"].cuda(),
        out["condition_tokens_text_image"].cuda(),
        None,
        num_inference_steps=8,
        text_guidance_scale=4.0,
    )
    assert torch.isfinite(pipe_bf16.decode_latents(final)).all()
