"""The whole model in one process, without any transport: the reference the served path must equal.

It runs exactly the code the stages run (the AR's `stage_ar.engine.DecodeEngine` with one request,
stepped in this thread; `stage_dit.pipeline.MammothDiTPipeline.__call__` with the image format as
its ``output_type`` for the DiT, the same steps the DiT stage's worker loop batches), so an image
served through gateway -> AR -> gRPC chunks -> DiT must be byte-identical to this one for the same
checkpoint, prompt, size, seed and parameters (the tests assert it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mammoth_app.make_checkpoint import materialize_checkpoint
from mammoth_core.decoding import SEQUENTIAL, DecodingOptions
from mammoth_core.limits import resolve_grid
from stage_ar.engine import CollectingSink, DecodeEngine, DecodeJob, Role
from stage_ar.loader import ARBundle, load_ar
from stage_dit.conditions import compute_answer_start_index
from stage_dit.denoise import ImageRequest
from stage_dit.loader import load_pipeline
from stage_dit.pipeline import MammothDiTPipeline


@dataclasses.dataclass
class InProcessResult:
    """Output of `InProcessModel.generate`.

    Attributes:
        image: encoded image bytes.
        hidden: CONDITION rows ``(len(prompt) + h*(w+1), hidden)`` in the AR dtype (``w x h``: the
            AR grid).
        token_ids: their token ids (prompt, then the grid; no look-ahead).
        prompt_len: ``len(prompt_ids)``.
        negative_rows: NEGATIVE rows or None.
        grid: the AR grid ``(w, h)`` in cells.
    """

    image: bytes
    hidden: torch.Tensor
    token_ids: list[int]
    prompt_len: int
    negative_rows: torch.Tensor | None
    grid: tuple[int, int] = (0, 0)


class InProcessModel:
    """AR + DiT loaded in this process from one checkpoint.

    Args:
        checkpoint: folder or ``builtin://tiny``.
        cache_dir: where the built-in checkpoint lives.
        device, dtype: for both stages (float32 on CPU).
        answer_boundary: the condition-split rule (the stages' ``answer_boundary`` setting).
    """

    def __init__(
        self,
        checkpoint: str,
        cache_dir: str,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        answer_boundary: str = "prompt_length",
    ):
        from mammoth_core.settings import ARSettings, DiTSettings

        ar_settings = ARSettings()
        materialize_checkpoint(checkpoint, cache_dir)  # a builtin:// one is made here, as `mammoth ar` does
        self.ar: ARBundle = load_ar(checkpoint, cache_dir, device, dtype)
        # the AR stage's engine, as `stage_ar.server.serve` builds it from the default settings
        self.engine = DecodeEngine(
            self.ar.new_sequence, ar_settings.max_running_sequences, model=self.ar.model,
            grid_ids=self.ar.grid_ids, max_sequence_length=ar_settings.max_sequence_length,
        )
        self.dit: MammothDiTPipeline = load_pipeline(
            DiTSettings(checkpoint=checkpoint, cache_dir=cache_dir, device=device, dtype=str(dtype).split(".")[-1])
        )
        self.answer_boundary = answer_boundary

    @torch.inference_mode()
    def generate(
        self,
        prompt: str,
        *,
        width: int,
        height: int,
        seed: int,
        num_inference_steps: int,
        text_guidance_scale: float,
        cfg_range: tuple[float, float] = (0.0, 1.0),
        negative_prompt: str | None = None,
        output_format: str = "png",
        output_compression: int = 0,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 0.0,
        ar_guidance_scale: float = 0.0,
        ar_grid: str = "auto",
        decoding: DecodingOptions = SEQUENTIAL,
    ) -> InProcessResult:
        """Generate one image; parameters mean what the gateway's request fields mean (``ar_grid``:
        ``"auto"`` or ``"WxH"``, resolved by `mammoth_core.limits.resolve_grid` as the gateway does).

        Raises:
            mammoth_core.limits.LimitError: ``ar_grid`` is malformed.
        """
        tok = self.ar.tokenizer
        w, h = resolve_grid(width, height, ar_grid)
        prompt_ids = tok.encode_t2i_prompt(prompt, w, h)
        negative_ids = tok.encode_negative_prompt(negative_prompt) if negative_prompt else None
        sink = CollectingSink()
        self.engine.run_job(DecodeJob(
            request_id="inprocess", epoch=0, prompt_ids=prompt_ids, negative_ids=negative_ids, ar_width=w,
            ar_height=h, seed=seed, temperature=temperature, top_k=top_k, top_p=top_p,
            ar_guidance_scale=ar_guidance_scale, sink=sink, on_progress=lambda done, total: None,
            on_done=lambda exc, stats: None, decoding=decoding,
        ))
        hidden, ids = sink.hidden(Role.CONDITION), sink.token_ids[Role.CONDITION]
        negative = sink.hidden(Role.NEGATIVE)
        answer_start = compute_answer_start_index(len(prompt_ids), len(ids), self.answer_boundary)
        condition = self.dit.prepare_conditions(hidden, torch.tensor(ids, dtype=torch.long), answer_start)
        neg = negative.to(self.dit.device, self.dit.dtype) if negative is not None else None
        request = ImageRequest(condition, neg, width, height, num_inference_steps, text_guidance_scale,
                               tuple(cfg_range), seed)
        data = self.dit(request, output_type=output_format, compression=output_compression)
        return InProcessResult(data, hidden, ids, len(prompt_ids), negative, (w, h))


def describe(result: InProcessResult) -> dict[str, Any]:
    """Counts of a result, for logs and tests."""
    return {
        "rows": int(result.hidden.shape[0]),
        "prompt_len": result.prompt_len,
        "bytes": len(result.image),
    }
