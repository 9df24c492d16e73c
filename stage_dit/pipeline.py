"""MammothModa2 DiT stage: conditions -> guided flow-matching loop -> VAE decode -> image tensor.

Mirrors upstream `t2i_utils.processing` / `decode_diffusion_image` (commit 2317bbce) and vllm-omni's
`MammothModa2DiTPipeline`, with the stated CFG rule (guidance at step i iff `scale > 1` and
`cfg_range[0] <= i/N <= cfg_range[1]`; upstream switches it off for good at the first step outside
the range) and both CFG branches batched into one transformer forward (padded and masked).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import AutoencoderKL

from stage_dit.condition_refiner import SimpleQFormerImageRefiner
from stage_dit.conditions import ConditionMode, ConditionTokenIds, build_condition
from stage_dit.scheduling_flow_match import FlowMatchEulerScheduler
from stage_dit.transformer_mammoth import MammothTransformer2DModel

StepCallback = Callable[[int, int, torch.Tensor], None]


def llm_hidden_size(config: dict[str, Any]) -> int:
    """AR hidden width from the top-level `config.json` (`llm_config.hidden_size`, flat upstream layout,
    else `llm_config.text_config.hidden_size`).

    Raises:
        ValueError: if neither is present.
    """
    llm = config.get("llm_config") or {}
    size = llm.get("hidden_size") or (llm.get("text_config") or {}).get("hidden_size")
    if not size:
        raise ValueError("config.json: llm_config.hidden_size is missing")
    return int(size)


@dataclass
class DiTModules:
    """The DiT stage's networks, attribute names equal to the checkpoint prefixes.

    Attributes:
        gen_transformer: `MammothTransformer2DModel` (`gen_transformer.*`).
        gen_image_condition_refiner: `SimpleQFormerImageRefiner` (`gen_image_condition_refiner.*`) or
            None when the config has no refiner.
        gen_vae: diffusers `AutoencoderKL` (`gen_vae.*`).
    """

    gen_transformer: MammothTransformer2DModel
    gen_image_condition_refiner: SimpleQFormerImageRefiner | None
    gen_vae: AutoencoderKL

    def named_modules_by_prefix(self) -> dict[str, torch.nn.Module]:
        """`{"gen_transformer": ..., "gen_image_condition_refiner": ..., "gen_vae": ...}` (None skipped),
        the checkpoint prefix (without the dot) of each module, for the weight loader."""
        items = {
            "gen_transformer": self.gen_transformer,
            "gen_image_condition_refiner": self.gen_image_condition_refiner,
            "gen_vae": self.gen_vae,
        }
        return {k: v for k, v in items.items() if v is not None}


def build_dit_modules(
    config: dict[str, Any], *, device: str | torch.device | None = None, dtype: torch.dtype | None = None
) -> DiTModules:
    """Build the DiT stage's modules from the top-level checkpoint `config.json` dict.

    Uses `gen_dit_config`, `gen_image_condition_refiner_config` (may be null), `gen_vae_config` and the
    LLM hidden size. Parameters are freshly initialised (PyTorch defaults) and the modules are in eval
    mode without gradients; load weights afterwards. With `device="meta"` no memory is allocated (shape
    checks).

    Raises:
        ValueError: if `gen_dit_config` or `gen_vae_config` is missing or inconsistent.
    """
    for key in ("gen_dit_config", "gen_vae_config"):
        if not isinstance(config.get(key), dict):
            raise ValueError(f"config.json: {key} is missing")
    hidden = llm_hidden_size(config)
    refiner_config = config.get("gen_image_condition_refiner_config")
    with torch.device(device) if device is not None else contextlib.nullcontext():
        transformer = MammothTransformer2DModel.from_config(config["gen_dit_config"], llm_hidden_size=hidden)
        refiner = (
            SimpleQFormerImageRefiner.from_config(refiner_config, hidden_size=hidden)
            if refiner_config is not None
            else None
        )
        vae = AutoencoderKL.from_config(config["gen_vae_config"])
    modules = DiTModules(transformer, refiner, vae)
    for module in modules.named_modules_by_prefix().values():
        module.eval().requires_grad_(False)
        if dtype is not None:
            # nn.Module.to: diffusers' ModelMixin.to logs a spurious fp32-modules warning on every cast.
            torch.nn.Module.to(module, dtype=dtype)
    return modules


class MammothDiTPipeline:
    """Text-to-image DiT stage of one model replica.

    Args:
        modules: loaded `DiTModules`.
        config: the top-level checkpoint `config.json` dict (`llm_config` ids, `gen_condition_mode`).
        device: where the modules live.
        dtype: compute dtype of the modules (float32 or bfloat16); latents are kept in float32.

    Raises:
        ValueError: on an unknown `gen_condition_mode`.
    """

    def __init__(
        self,
        modules: DiTModules,
        config: dict[str, Any],
        *,
        device: str | torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.modules = modules
        self.transformer = modules.gen_transformer
        self.refiner = modules.gen_image_condition_refiner
        self.vae = modules.gen_vae
        self.device = torch.device(device)
        self.dtype = dtype
        self.token_config = ConditionTokenIds.from_llm_config(config.get("llm_config") or {})
        self.condition_mode = ConditionMode(config.get("gen_condition_mode", ConditionMode.IMAGE.value))
        self.llm_hidden_size = llm_hidden_size(config)
        self.latent_channels = int(self.transformer.config.in_channels)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.size_multiple = self.vae_scale_factor * int(self.transformer.config.patch_size)

    # -- conditions -------------------------------------------------------------------------------

    @torch.inference_mode()
    def prepare_conditions(
        self, hidden_states: torch.Tensor, token_ids: torch.Tensor, answer_start_index: int
    ) -> torch.Tensor:
        """Positive condition of one request (computed once, reused at every step).

        Args:
            hidden_states: AR rows `(rows, llm_hidden)`, any float dtype, any device.
            token_ids: int `(rows,)`.
            answer_start_index: see `conditions.compute_answer_start_index`.

        Returns:
            `(cond_len, llm_hidden)` in the pipeline dtype on its device.

        Raises:
            ValueError: on wrong shapes or when there is no image-condition row.
        """
        if hidden_states.ndim != 2 or hidden_states.shape[1] != self.llm_hidden_size:
            raise ValueError(
                f"hidden_states must be (rows, {self.llm_hidden_size}), got {tuple(hidden_states.shape)}"
            )
        condition = build_condition(
            hidden_states.to(self.device, self.dtype),
            token_ids.to(self.device),
            answer_start_index,
            token_config=self.token_config,
            refiner=self.refiner,
            mode=self.condition_mode,
        )
        return condition.to(self.dtype)

    # -- sampling ---------------------------------------------------------------------------------

    def prepare_latents(self, *, width: int, height: int, seed: int) -> torch.Tensor:
        """Initial noise `(1, C, height/8, width/8)` float32 from a CPU `torch.Generator` seeded with `seed`
        (device independent), moved to the pipeline device.

        Raises:
            ValueError: if width/height are not positive multiples of `size_multiple` (16).
        """
        for name, value in (("width", width), ("height", height)):
            if int(value) != value or value <= 0 or value % self.size_multiple:
                raise ValueError(f"{name} must be a positive multiple of {self.size_multiple}, got {value}")
        shape = (1, self.latent_channels, height // self.vae_scale_factor, width // self.vae_scale_factor)
        generator = torch.Generator(device="cpu").manual_seed(int(seed))
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(self.device)

    def _check_condition(self, name: str, condition: torch.Tensor) -> torch.Tensor:
        if condition.ndim != 2 or condition.shape[1] != self.llm_hidden_size:
            raise ValueError(f"{name} must be (rows, {self.llm_hidden_size}), got {tuple(condition.shape)}")
        return condition.to(self.device, self.dtype)

    def _batch_conditions(self, conditions: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pad conditions of possibly different lengths into the transformer's inputs.

        Returns `(text (batch, max_len, llm_hidden) pipeline dtype, mask bool (batch, max_len))`; built
        once per request by `denoise` and reused at every step.
        """
        batch = len(conditions)
        max_len = max(c.shape[0] for c in conditions)
        text = torch.zeros(batch, max_len, self.llm_hidden_size, dtype=self.dtype, device=self.device)
        mask = torch.zeros(batch, max_len, dtype=torch.bool, device=self.device)
        for i, c in enumerate(conditions):
            text[i, : c.shape[0]] = c
            mask[i, : c.shape[0]] = True
        return text, mask

    def _velocity(
        self,
        latents: torch.Tensor,
        t: torch.Tensor,
        conditions: list[torch.Tensor] | None,
        batched: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """One batched transformer forward over several conditions of possibly different lengths.

        `batched` (from `_batch_conditions`) replaces `conditions` when given. Returns one float32
        velocity `(1, C, h, w)` per condition.
        """
        text, mask = batched if batched is not None else self._batch_conditions(conditions or [])
        batch = text.shape[0]
        v = self.transformer(
            hidden_states=latents.expand(batch, -1, -1, -1),
            timestep=t.reshape(1).expand(batch).to(self.device, torch.float32),
            text_hidden_states=text,
            text_attention_mask=mask,
        )
        return [v[i : i + 1].float() for i in range(batch)]

    @torch.inference_mode()
    def denoise(
        self,
        latents: torch.Tensor,
        condition: torch.Tensor,
        negative: torch.Tensor | None,
        *,
        num_inference_steps: int,
        text_guidance_scale: float,
        cfg_range: tuple[float, float] = (0.0, 1.0),
        callback: StepCallback | None = None,
    ) -> torch.Tensor:
        """Run the guided Euler loop from `latents` (t = 0) to t = 1.

        At step i of N: `v = v_cond`; if `text_guidance_scale > 1` and `cfg_range[0] <= i/N <=
        cfg_range[1]`, `v = v_uncond + s (v_cond - v_uncond)` with both branches in one forward. The
        unconditional branch is `negative` (raw AR rows of a negative prompt) or, when None, an empty
        condition (zero rows, as vllm-omni).

        Args:
            latents: `(1, C, h, w)` initial noise.
            condition: `(cond_len, llm_hidden)` from `prepare_conditions`.
            negative: `(neg_len, llm_hidden)` or None.
            num_inference_steps: N >= 1.
            text_guidance_scale: s (finite).
            cfg_range: `(start, end)` with `0 <= start <= end <= 1`.
            callback: called as `callback(step_index, total_steps, latents)` after each step, with the
                0-based index of the finished step (progress = (step_index + 1) / total_steps) and the
                float32 latents after it.

        Returns:
            final latents float32 `(1, C, h, w)`.

        Raises:
            ValueError: on bad shapes or parameters.
        """
        condition = self._check_condition("condition", condition)
        if negative is not None:
            negative = self._check_condition("negative", negative)
        if not math.isfinite(float(text_guidance_scale)):
            raise ValueError(f"text_guidance_scale must be finite, got {text_guidance_scale}")
        if len(cfg_range) != 2 or not 0.0 <= float(cfg_range[0]) <= float(cfg_range[1]) <= 1.0:
            raise ValueError(f"cfg_range must satisfy 0 <= start <= end <= 1, got {tuple(cfg_range)}")
        unconditional = negative if negative is not None else condition.new_zeros(0, self.llm_hidden_size)
        scheduler = FlowMatchEulerScheduler()
        timesteps = scheduler.set_timesteps(num_inference_steps, num_tokens=latents.shape[-2] * latents.shape[-1])
        latents = latents.to(self.device, torch.float32)
        total = len(timesteps)
        both = alone = None  # padded condition batches, built once per request
        for i, t in enumerate(timesteps):
            guided = text_guidance_scale > 1.0 and cfg_range[0] <= i / total <= cfg_range[1]
            if guided:
                both = both or self._batch_conditions([condition, unconditional])
                v_cond, v_uncond = self._velocity(latents, t, None, both)
                v = v_uncond + text_guidance_scale * (v_cond - v_uncond)
            else:
                alone = alone or self._batch_conditions([condition])
                (v,) = self._velocity(latents, t, None, alone)
            latents = scheduler.step(v, i, latents)
            if callback is not None:
                callback(i, total, latents)
        return latents

    @torch.inference_mode()
    def decode_latents(self, latents: torch.Tensor, *, clamp: bool = True) -> torch.Tensor:
        """VAE-decode `(1, C, h, w)` latents: `decode(latents / scaling_factor + shift_factor)`.

        Usable on intermediate latents for previews. Returns float32 `(3, 8h, 8w)`, clamped to [-1, 1]
        unless `clamp=False` (raw decoder output).
        """
        config = self.vae.config
        x = latents.to(self.device, torch.float32)
        if config.scaling_factor is not None:
            x = x / config.scaling_factor
        if config.shift_factor is not None:
            x = x + config.shift_factor
        vae_dtype = next(self.vae.parameters()).dtype
        image = self.vae.decode(x.to(vae_dtype), return_dict=False)[0][0].float()
        return image.clamp(-1.0, 1.0) if clamp else image

    def generate(
        self,
        condition: torch.Tensor,
        negative: torch.Tensor | None,
        *,
        width: int,
        height: int,
        num_inference_steps: int,
        text_guidance_scale: float,
        cfg_range: tuple[float, float] = (0.0, 1.0),
        seed: int,
        callback: StepCallback | None = None,
    ) -> torch.Tensor:
        """Generate one image: `prepare_latents` -> `denoise` -> `decode_latents`.

        Args: see `prepare_latents` and `denoise`.

        Returns:
            float32 `(3, height, width)` in [-1, 1] on the pipeline device.

        Raises:
            ValueError: on bad sizes, shapes or parameters.
        """
        latents = self.prepare_latents(width=width, height=height, seed=seed)
        latents = self.denoise(
            latents,
            condition,
            negative,
            num_inference_steps=num_inference_steps,
            text_guidance_scale=text_guidance_scale,
            cfg_range=cfg_range,
            callback=callback,
        )
        return self.decode_latents(latents)
