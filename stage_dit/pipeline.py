"""MammothModa2 DiT stage: conditions -> guided flow-matching loop -> VAE decode -> image tensor.

Mirrors upstream `t2i_utils.processing` / `decode_diffusion_image` (commit 2317bbce) and vllm-omni's
`MammothModa2DiTPipeline`, with the stated CFG rule (guidance at step i iff `scale > 1` and
`cfg_range[0] <= i/N <= cfg_range[1]`; upstream switches it off for good at the first step outside
the range) and both CFG branches batched into one transformer forward (padded and masked).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers import AutoencoderKL

from mammoth_core import limits
from stage_dit.condition_refiner import SimpleQFormerImageRefiner
from stage_dit.conditions import ConditionMode, ConditionTokenIds, build_condition
from stage_dit.denoise import ConditionTooLongError, DenoiseState, ImageRequest, denoise_step
from stage_dit.graphs import GraphCache
from stage_dit.images import FORMATS, encode_image
from stage_dit.scheduling_flow_match import FlowMatchEulerScheduler
from stage_dit.step_cache import StepCacheConfig
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
        scheduler: the `FlowMatchEulerScheduler` component (no weights; each request runs its own
            copy, `MammothDiTPipeline.new_scheduler`).
    """

    gen_transformer: MammothTransformer2DModel
    gen_image_condition_refiner: SimpleQFormerImageRefiner | None
    gen_vae: AutoencoderKL
    scheduler: FlowMatchEulerScheduler = field(default_factory=FlowMatchEulerScheduler)

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
    checks). The scheduler component is built with its defaults (upstream's, dynamic shift).

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
    modules = DiTModules(transformer, refiner, vae, FlowMatchEulerScheduler())
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
        self.scheduler = modules.scheduler
        self.device = torch.device(device)
        self.dtype = dtype
        self.token_config = ConditionTokenIds.from_llm_config(config.get("llm_config") or {})
        self.condition_mode = ConditionMode(config.get("gen_condition_mode", ConditionMode.IMAGE.value))
        self.llm_hidden_size = llm_hidden_size(config)
        self.latent_channels = int(self.transformer.config.in_channels)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.size_multiple = self.vae_scale_factor * int(self.transformer.config.patch_size)
        #: CUDA graphs of the step forward by shape (`stage_dit.graphs`); None = always eager (CPU)
        self.step_graphs = GraphCache() if self.device.type == "cuda" else None

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

    def check_condition(self, name: str, condition: torch.Tensor) -> torch.Tensor:
        """``condition`` `(rows, llm_hidden)` on the pipeline device and dtype.

        ``name``: ``"condition"`` (the prompt's) or ``"negative"`` (the negative prompt's raw rows).

        Raises:
            ConditionTooLongError: more rows than the transformer's caption positions hold
                (`mammoth_core.limits.max_caption_rows` of its ``axes_lens``): the request's own fault,
                which no retry fixes (the message names the request field to shorten).
            ValueError: on another shape (the message names ``name``).
        """
        if condition.ndim != 2 or condition.shape[1] != self.llm_hidden_size:
            raise ValueError(f"{name} must be (rows, {self.llm_hidden_size}), got {tuple(condition.shape)}")
        limit = limits.max_caption_rows(self.transformer.config.axes_lens)  # a parallel wrapper has it too
        if condition.shape[0] > limit:
            field = "negative_prompt" if name == "negative" else "prompt"
            raise ConditionTooLongError(
                f"the {field.replace('_', ' ')} gives a condition of {condition.shape[0]} rows; this DiT's caption "
                f"positions hold at most {limit} (gen_dit_config.axes_lens[0] - 1): shorten {field}", field)
        return condition.to(self.device, self.dtype)

    def new_scheduler(self) -> FlowMatchEulerScheduler:
        """A fresh scheduler from the loaded component's config (each request owns one)."""
        return FlowMatchEulerScheduler.from_config(self.scheduler.config)

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
        cache: StepCacheConfig | None = None,
    ) -> torch.Tensor:
        """Run the guided Euler loop of one request from `latents` (t = 0) to t = 1: `denoise_step`
        over a group of one (the rule and the unconditional branch: `stage_dit.denoise`).

        Args:
            latents: `(1, C, h, w)` initial noise.
            condition: `(cond_len, llm_hidden)` from `prepare_conditions`.
            negative: `(neg_len, llm_hidden)` or None.
            num_inference_steps: N >= 1.
            text_guidance_scale: s (finite).
            cfg_range: `(start, end)` with `0 <= start <= end <= 1`.
            callback: called as `callback(step_index, total_steps, latents)` after each step, with the
                0-based index of the finished step and the float32 latents after it.
            cache: opt-in step cache (`stage_dit.step_cache`), default off.

        Returns:
            final latents float32 `(1, C, h, w)`.

        Raises:
            ValueError: on bad shapes or parameters.
        """
        request = ImageRequest(condition, negative, width=0, height=0, num_inference_steps=num_inference_steps,
                               text_guidance_scale=text_guidance_scale, cfg_range=tuple(cfg_range), cache=cache)
        state = DenoiseState(self, request, latents)
        while not state.done:
            denoise_step(self.transformer, [state], self.step_graphs)
            if callback is not None:
                callback(state.step - 1, state.total, state.latents)
        return state.latents

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

    @torch.inference_mode()
    def postprocess(self, latents: torch.Tensor, output_type: str = "pt", compression: int = 0):
        """Final latents -> the requested output (diffusers' ``output_type``).

        Args:
            latents: float32 `(1, C, h, w)`.
            output_type: ``"latent"`` (the latents themselves), ``"pt"`` (float32 `(3, 8h, 8w)` in
                [-1, 1]) or an image format of `stage_dit.images.FORMATS` (``"png"``, ``"jpeg"``,
                ``"webp"``): the encoded bytes.
            compression: JPEG/WebP ``output_compression`` (0..100).

        Raises:
            ValueError: on an unknown ``output_type``.
        """
        if output_type == "latent":
            return latents
        if output_type != "pt" and output_type.lower() not in FORMATS:
            raise ValueError(f"output_type must be 'latent', 'pt' or one of {sorted(FORMATS)}, got {output_type!r}")
        image = self.decode_latents(latents)
        return image if output_type == "pt" else self.encode(image, output_type, compression)

    def encode(self, image: torch.Tensor, fmt: str, compression: int = 0) -> bytes:
        """The image encoder component (`stage_dit.images.encode_image`): `(3, H, W)` in [-1, 1] ->
        PNG/JPEG/WebP bytes.

        Raises:
            ValueError: on an unknown format or a bad shape.
        """
        return encode_image(image, fmt, compression)

    def __call__(self, request: ImageRequest, *, output_type: str = "pt", compression: int = 0,
                 callback: StepCallback | None = None):
        """One image in this thread: noise from the seed, `denoise`, `postprocess` (the DiT stage's
        engine runs the same steps, batched across requests, `stage_dit.engine`).

        Raises:
            ValueError: on bad sizes, shapes or parameters.
        """
        latents = self.prepare_latents(width=request.width, height=request.height, seed=request.seed)
        latents = self.denoise(
            latents, request.condition, request.negative, num_inference_steps=request.num_inference_steps,
            text_guidance_scale=request.text_guidance_scale, cfg_range=request.cfg_range, callback=callback,
            cache=request.cache,
        )
        return self.postprocess(latents, output_type, compression)

    def generate(self, condition: torch.Tensor, negative: torch.Tensor | None, *, width: int, height: int,
                 num_inference_steps: int, text_guidance_scale: float, cfg_range: tuple[float, float] = (0.0, 1.0),
                 seed: int, callback: StepCallback | None = None) -> torch.Tensor:
        """`__call__` with keyword arguments and ``output_type="pt"``: float32 `(3, height, width)` in
        [-1, 1] on the pipeline device.

        Raises:
            ValueError: on bad sizes, shapes or parameters.
        """
        request = ImageRequest(condition, negative, width, height, num_inference_steps, text_guidance_scale,
                               tuple(cfg_range), seed)
        return self(request, output_type="pt", callback=callback)
