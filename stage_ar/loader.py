"""Load the AR stage's model, tokenizer and generation config from a checkpoint folder."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from mammoth_core import limits
from mammoth_core.checkpoint_check import verify_parts
from mammoth_core.checkpoint import AR_PREFIX, Checkpoint, resolve_checkpoint
from mammoth_core.distributed import GroupRank
from stage_ar import gemv
from stage_ar.checkpoint_part import CHECKPOINT_PART
from stage_ar.fp8 import stores_fp8
from stage_ar.generation import T2ISequence
from stage_ar.linear import WEIGHTS_DTYPES, GemvLinear, quantize_fp8_, select_backend, set_linear_backend
from stage_ar.modeling_mammoth_ar import MammothARForCausalLM
from stage_ar.sampling import GridConstrainedSampler, T2IGenerationConfig, read_t2i_generation_config
from stage_ar.tokenization_mammoth import MammothTokenizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ARBundle:
    """Everything the AR stage needs from a checkpoint.

    Attributes:
        model: `MammothARForCausalLM` on ``device`` in ``dtype``, eval mode.
        tokenizer: `MammothTokenizer` from the checkpoint's tiktoken files.
        generation_config: `T2IGenerationConfig` from ``t2i_generation_config.json``.
        config: the top-level ``config.json`` dict.
    """

    model: MammothARForCausalLM
    tokenizer: MammothTokenizer
    generation_config: T2IGenerationConfig
    config: dict[str, Any]
    device: torch.device
    dtype: torch.dtype

    @property
    def hidden_size(self) -> int:
        return int(self.config["llm_config"]["hidden_size"])

    @property
    def negative_row_limit(self) -> int | None:
        """Most tokens a negative prompt may have: its raw rows are the DiT's unconditional condition,
        bounded by the DiT's rotary table (`mammoth_core.limits.max_caption_rows` of the checkpoint's
        ``gen_dit_config.axes_lens``); None when the checkpoint does not say (the DiT still checks)."""
        axes_lens = (self.config.get("gen_dit_config") or {}).get("axes_lens")
        return limits.max_caption_rows(axes_lens) if axes_lens else None

    def make_sampler(
        self, ar_width: int, ar_height: int, seed: int, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 0.0
    ) -> GridConstrainedSampler:
        """A seeded grid sampler; 0 for temperature/top_k/top_p keeps the checkpoint's default."""
        return GridConstrainedSampler.from_generation_config(
            self.generation_config,
            ar_width,
            ar_height,
            seed,
            temperature=temperature or None,
            top_k=top_k or None,
            top_p=top_p or None,
        )


    def new_sequence(self, job: Any) -> T2ISequence:
        """The engine's sequence factory: a seeded sampler and a `T2ISequence` for a
        `stage_ar.engine.DecodeJob`."""
        sampler = self.make_sampler(
            job.ar_width, job.ar_height, job.seed, temperature=job.temperature, top_k=job.top_k, top_p=job.top_p)
        return T2ISequence(self.model, job.prompt_ids, job.ar_width, job.ar_height, sampler,
                           negative_prompt_ids=job.negative_ids, ar_guidance_scale=job.ar_guidance_scale,
                           decoding=job.decoding)

    @property
    def grid_ids(self) -> tuple[int, int, int]:
        """``(eol_token_id, visual_token_start_id, visual_token_end_id)`` of the generation config."""
        g = self.generation_config
        return g.eol_token_id, g.visual_token_start_id, g.visual_token_end_id


def load_ar(checkpoint: str, cache_dir: str, device: str, dtype: torch.dtype, *, weights_dtype: str = "auto",
            linear_backend: str = "auto", tensor_parallel: GroupRank | None = None) -> ARBundle:
    """Build the AR from ``config.json`` and load ``llm_model.*`` (vision tower skipped) strictly.

    Args:
        checkpoint, cache_dir: the checkpoint folder or URI (`resolve_checkpoint`).
        device, dtype: where and in which dtype the model lives (activations and KV in ``dtype``).
        weights_dtype: ``"auto"`` (the model dtype), ``"fp8"``: after loading, the weights a
            visual token reads (`MammothARForCausalLM.visual_token_linears`) are converted to E4M3
            with per-output-channel scales (`stage_ar.linear`), the rest stays in ``dtype``; or
            ``"fp8-w8a8"``: the same weights, and the GEMV backend quantizes each activation row
            those projections read to E4M3 with its own scale (``fp8_compute="fp8"``,
            `stage_ar.fp8_activations`). A checkpoint that stores those weights in FP8 already
            (`stage_ar.fp8.stores_fp8`) loads its codes and scales as they are, ``"auto"`` meaning
            ``"fp8"`` there.
        linear_backend: `stage_ar.linear.BACKENDS` (``"auto"``: Triton GEMV on CUDA, torch on CPU).
        tensor_parallel: this rank's place among the stage's ranks: the weights are read into host
            memory, sharded there (`stage_ar.tensor_parallel.shard_ar_model_`), and only the rank's
            shard goes to ``device``; the FP8 conversion then applies to the shard (the codes of an
            FP8 checkpoint are split instead, their row scales with the rows).

    Raises:
        mammoth_core.checkpoint.CheckpointError: missing/unexpected/mis-shaped tensors or files; FP8 row
            scales that are not finite and > 0 (`mammoth_core.checkpoint_check.check_parts`).
        ValueError: an unknown ``weights_dtype`` or ``linear_backend``; ``"fp8-w8a8"`` where the
            linear backend is not the GEMV (torch chosen, or no CUDA / triton: only the GEMV kernels
            quantize activations), before any weight is read; a ``MAMMOTH_GEMV_PICKS`` file that is
            not a picks file (`stage_ar.gemv.pinned_picks`).
        OSError: a ``MAMMOTH_GEMV_PICKS`` file that cannot be read.
    """
    if weights_dtype not in WEIGHTS_DTYPES:
        raise ValueError(f"weights_dtype must be one of {WEIGHTS_DTYPES}, got {weights_dtype!r}")
    w8a8 = weights_dtype == "fp8-w8a8"
    backend = select_backend(linear_backend, device, fp8_compute="fp8" if w8a8 else None)
    if w8a8 and not isinstance(backend, GemvLinear):
        raise ValueError(
            f"weights_dtype 'fp8-w8a8' quantizes activations inside the GEMV kernels, so it needs the gemv "
            f"linear backend (CUDA with triton, or Triton's interpreter with linear_backend 'gemv'); here "
            f"linear_backend {linear_backend!r} on {device} gives {backend.name!r}. Use 'fp8' (FP8 weights, "
            f"activations in the model dtype) on this device")
    gemv.pinned_picks(torch.device(device))  # a bad MAMMOTH_GEMV_PICKS fails here, before any weight is read
    t0 = time.perf_counter()
    path = resolve_checkpoint(checkpoint, cache_dir)
    verify_parts(path, [CHECKPOINT_PART])  # its tensors checked (headers only) before any is read
    ckpt = Checkpoint(path)
    sharded = tensor_parallel is not None and tensor_parallel.world_size > 1
    stored_fp8 = stores_fp8(ckpt.llm_config)
    if stored_fp8 and weights_dtype == "auto":
        weights_dtype = "fp8"  # the checkpoint's own format: FP8 weights, activations in dtype
    load_device = "cpu" if sharded else device  # shard in host memory: the GPU sees only the shard
    with torch.device(load_device):
        model = MammothARForCausalLM.from_llm_config(ckpt.llm_config)
    model.to(dtype=dtype)
    if stored_fp8:  # after the cast, which would widen codes: the codes and scales load as stored
        for linear in model.visual_token_linears():
            linear.hold_fp8()
    ckpt.load_module(model, AR_PREFIX, device=load_device, dtype=None if stored_fp8 else dtype)
    model.eval().requires_grad_(False)
    if sharded:
        from stage_ar.tensor_parallel import shard_ar_model_

        shard_ar_model_(model, tensor_parallel)
        model.to(device=device)
    if stored_fp8:
        logger.info("AR visual-token weights loaded as the checkpoint stores them: FP8 E4M3 codes and row scales")
    elif weights_dtype in ("fp8", "fp8-w8a8"):
        saved = quantize_fp8_(model.visual_token_linears())
        logger.info("AR visual-token weights converted to FP8 E4M3 (%.2f GB less)", saved / 1e9)
    set_linear_backend(model, backend)
    tokenizer = MammothTokenizer.from_pretrained(path)
    gen = read_t2i_generation_config(path)
    logger.info("AR loaded from %s on %s/%s (weights %s, linear backend %s) in %.1f s", path, device, dtype,
                weights_dtype, backend.name, time.perf_counter() - t0)
    return ARBundle(model, tokenizer, gen, ckpt.config, torch.device(device), dtype)
