"""Load the DiT stage's model from a checkpoint folder, only through the real-checkpoint loader."""

from __future__ import annotations

import logging
import time

from mammoth_core.checkpoint_check import verify_parts
from mammoth_core.checkpoint import Checkpoint, resolve_checkpoint
from mammoth_core.settings import DiTSettings
from stage_dit.checkpoint_part import CHECKPOINT_PART
from stage_dit.pipeline import MammothDiTPipeline, build_dit_modules

logger = logging.getLogger(__name__)


def load_pipeline(settings: DiTSettings) -> MammothDiTPipeline:
    """Build the DiT modules from ``config.json`` and load ``gen_transformer.*``,
    ``gen_image_condition_refiner.*`` and ``gen_vae.*`` strictly onto the settings' device/dtype.

    Raises:
        mammoth_core.checkpoint.CheckpointError: missing/unexpected/mis-shaped tensors or files.
    """
    t0 = time.perf_counter()
    path = resolve_checkpoint(settings.checkpoint, settings.cache_dir)
    verify_parts(path, [CHECKPOINT_PART])  # its tensors checked (headers only) before any is read
    ckpt = Checkpoint(path)
    device, dtype = settings.resolved_device(), settings.resolved_dtype()
    modules = build_dit_modules(ckpt.config, device=device, dtype=dtype)
    for prefix, module in modules.named_modules_by_prefix().items():
        ckpt.load_module(module, prefix + ".", device=device, dtype=dtype)
    pipeline = MammothDiTPipeline(modules, ckpt.config, device=device, dtype=dtype)
    logger.info("DiT loaded from %s on %s/%s in %.1f s", path, device, dtype, time.perf_counter() - t0)
    return pipeline
