"""MammothDiTPipeline (conditions, guided loop, decode) on the tiny reference weights, and image encoding."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from dit_reference import config, max_abs, outputs, pipeline
from PIL import Image

from stage_dit.images import encode_image, to_uint8
from stage_dit.scheduling_flow_match import FlowMatchEulerScheduler



@pytest.fixture(scope="module")
def pipe():
    return pipeline()


@pytest.fixture(scope="module")
def out():
    return outputs()


def test_prepare_conditions_matches_upstream(pipe, out):
    condition = pipe.prepare_conditions(out["cond_last_hidden_states"], out["cond_input_ids"][0], 23)
    assert condition.dtype == torch.float32
    assert max_abs(condition, out["condition_tokens_text_image"]) < 1e-4


def test_prepare_conditions_rejects_bad_input(pipe, out):
    with pytest.raises(ValueError, match="hidden_states"):
        pipe.prepare_conditions(torch.zeros(33, 32), out["cond_input_ids"][0], 23)
    with pytest.raises(ValueError, match="no image-condition rows"):
        pipe.prepare_conditions(out["cond_last_hidden_states"][:20], out["cond_input_ids"][0][:20], 10)


def manual_loop(pipe, latents, condition, uncond, steps, scale, guided_steps):
    """Reference loop with separate (unbatched) forwards and an explicit set of guided steps."""
    scheduler = FlowMatchEulerScheduler()
    timesteps = scheduler.set_timesteps(steps, num_tokens=latents.shape[-2] * latents.shape[-1])
    x = latents.clone()
    with torch.inference_mode():
        for i, t in enumerate(timesteps):
            v = pipe.transformer(x, t[None], condition[None], torch.ones(1, condition.shape[0], dtype=torch.bool))
            if i in guided_steps:
                v_u = pipe.transformer(x, t[None], uncond[None], torch.ones(1, uncond.shape[0], dtype=torch.bool))
                v = v_u + scale * (v - v_u)
            x = scheduler.step(v, i, x)
    return x


def test_cfg_range_applies_per_step(pipe, out):
    latents = pipe.prepare_latents(width=64, height=64, seed=5)
    cond, neg = out["condition_tokens_image"], out["neg_condition_tokens"]
    ours = pipe.denoise(latents, cond, neg, num_inference_steps=4, text_guidance_scale=3.0, cfg_range=(0.5, 1.0))
    # i/N = 0, .25 outside; .5, .75 inside (upstream's loop would have switched guidance off for good at step 0)
    assert max_abs(ours, manual_loop(pipe, latents, cond, neg, 4, 3.0, {2, 3})) < 1e-4
    assert max_abs(ours, manual_loop(pipe, latents, cond, neg, 4, 3.0, set())) > 1e-3


def test_empty_unconditional_branch_without_negative(pipe, out):
    latents = pipe.prepare_latents(width=64, height=64, seed=6)
    cond = out["condition_tokens_text_image"]
    ours = pipe.denoise(latents, cond, None, num_inference_steps=3, text_guidance_scale=4.0)
    assert torch.isfinite(ours).all()
    assert max_abs(ours, manual_loop(pipe, latents, cond, torch.zeros(0, 64), 3, 4.0, {0, 1, 2})) < 1e-4


def test_scale_one_means_no_guidance(pipe, out):
    latents = pipe.prepare_latents(width=64, height=64, seed=7)
    cond = out["condition_tokens_image"]
    with_neg = pipe.denoise(latents, cond, out["neg_condition_tokens"], num_inference_steps=2, text_guidance_scale=1.0)
    without = pipe.denoise(latents, cond, None, num_inference_steps=2, text_guidance_scale=1.0)
    assert torch.equal(with_neg, without)
    assert max_abs(with_neg, manual_loop(pipe, latents, cond, cond, 2, 1.0, set())) < 1e-4


def test_generate_is_seeded_and_reports_every_step(pipe, out):
    seen = []

    def callback(step_index, total_steps, latents):
        seen.append((step_index, total_steps, tuple(latents.shape)))
        preview = pipe.decode_latents(latents)
        assert preview.shape == (3, 64, 48)

    kwargs = dict(width=48, height=64, num_inference_steps=3, text_guidance_scale=4.0, seed=11)
    image = pipe.generate(out["condition_tokens_text_image"], out["neg_condition_tokens"], callback=callback, **kwargs)
    assert seen == [(0, 3, (1, 16, 8, 6)), (1, 3, (1, 16, 8, 6)), (2, 3, (1, 16, 8, 6))]
    assert image.shape == (3, 64, 48) and image.dtype == torch.float32
    assert image.min() >= -1.0 and image.max() <= 1.0
    again = pipe.generate(out["condition_tokens_text_image"], out["neg_condition_tokens"], **kwargs)
    assert torch.equal(image, again)
    other = pipe.generate(out["condition_tokens_text_image"], out["neg_condition_tokens"], **{**kwargs, "seed": 12})
    assert not torch.equal(image, other)


@pytest.mark.parametrize(
    "change",
    [
        {"width": 60},
        {"height": 0},
        {"num_inference_steps": 0},
        {"cfg_range": (0.8, 0.2)},
        {"cfg_range": (0.0, 1.5)},
        {"text_guidance_scale": float("nan")},
    ],
)
def test_generate_rejects_bad_parameters(pipe, out, change):
    kwargs = dict(width=64, height=64, num_inference_steps=2, text_guidance_scale=4.0, seed=0) | change
    with pytest.raises(ValueError):
        pipe.generate(out["condition_tokens_image"], None, **kwargs)


def test_generate_rejects_bad_condition_shapes(pipe, out):
    kwargs = dict(width=64, height=64, num_inference_steps=1, text_guidance_scale=4.0, seed=0)
    with pytest.raises(ValueError, match="condition"):
        pipe.generate(torch.zeros(4, 32), None, **kwargs)
    with pytest.raises(ValueError, match="negative"):
        pipe.generate(out["condition_tokens_image"], torch.zeros(2, 3, 64), **kwargs)


def test_pipeline_reads_mode_and_ids_from_config(pipe):
    assert pipe.condition_mode.value == config()["gen_condition_mode"] == "text_image"
    assert pipe.token_config.gen_vocab_start_index == 512
    assert pipe.vae_scale_factor == 8 and pipe.size_multiple == 16


# -- images ---------------------------------------------------------------------------------------


def gradient_image() -> torch.Tensor:
    ys, xs = torch.meshgrid(torch.linspace(-1, 1, 16), torch.linspace(-1, 1, 24), indexing="ij")
    return torch.stack([xs, ys, xs * ys])


def test_to_uint8_maps_and_clamps():
    image = torch.tensor([-1.0, 0.0, 1.0, 2.0, -3.0, 0.5]).view(3, 1, 2)
    pixels = to_uint8(image)
    assert pixels.shape == (1, 2, 3) and pixels.dtype == np.uint8
    assert pixels[0, :, 0].tolist() == [0, 128]
    assert pixels[0, :, 1].tolist() == [255, 255]
    assert pixels[0, :, 2].tolist() == [0, 191]
    with pytest.raises(ValueError):
        to_uint8(torch.zeros(4, 2, 2))


def test_png_is_lossless_and_deterministic():
    image = gradient_image()
    data = encode_image(image)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data == encode_image(image, "PNG", compression=50)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))), to_uint8(image))


@pytest.mark.parametrize(("fmt", "pil_format"), [("jpeg", "JPEG"), ("jpg", "JPEG"), ("webp", "WEBP")])
def test_lossy_formats_use_quality_from_compression(fmt, pil_format):
    image = gradient_image()
    best = encode_image(image, fmt, compression=0)
    worst = encode_image(image, fmt, compression=95)
    assert Image.open(io.BytesIO(best)).format == pil_format
    assert len(worst) < len(best)
    assert encode_image(image, fmt, compression=250) == encode_image(image, fmt, compression=100)
    decoded = np.asarray(Image.open(io.BytesIO(best)).convert("RGB")).astype(int)
    assert np.abs(decoded - to_uint8(image).astype(int)).max() < 40


def test_unknown_format_is_rejected():
    with pytest.raises(ValueError, match="unsupported image format"):
        encode_image(gradient_image(), "gif")
