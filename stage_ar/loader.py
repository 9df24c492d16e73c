"""Load the AR stage's model, tokenizer and generation config from a checkpoint folder."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from mammoth_core.check_checkpoint import verify_checkpoint
from mammoth_core.checkpoint import AR_PREFIX, Checkpoint, resolve_checkpoint
from stage_ar.generation import T2ISequence
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
                           negative_prompt_ids=job.negative_ids, ar_guidance_scale=job.ar_guidance_scale)

    @property
    def grid_ids(self) -> tuple[int, int, int]:
        """``(eol_token_id, visual_token_start_id, visual_token_end_id)`` of the generation config."""
        g = self.generation_config
        return g.eol_token_id, g.visual_token_start_id, g.visual_token_end_id


def load_ar(checkpoint: str, cache_dir: str, device: str, dtype: torch.dtype) -> ARBundle:
    """Build the AR from ``config.json`` and load ``llm_model.*`` (vision tower skipped) strictly.

    Raises:
        mammoth_core.checkpoint.CheckpointError: missing/unexpected/mis-shaped tensors or files.
    """
    t0 = time.perf_counter()
    path = resolve_checkpoint(checkpoint, cache_dir)
    verify_checkpoint(path)  # every tensor checked (headers only) before any weight is read
    ckpt = Checkpoint(path)
    with torch.device(device):
        model = MammothARForCausalLM.from_llm_config(ckpt.llm_config)
    model.to(dtype=dtype)
    ckpt.load_module(model, AR_PREFIX, device=device, dtype=dtype)
    model.eval().requires_grad_(False)
    tokenizer = MammothTokenizer.from_pretrained(path)
    gen = read_t2i_generation_config(path)
    logger.info("AR loaded from %s on %s/%s in %.1f s", path, device, dtype, time.perf_counter() - t0)
    return ARBundle(model, tokenizer, gen, ckpt.config, torch.device(device), dtype)
