"""What the DiT stage reads from a checkpoint (`CHECKPOINT_PART`): checked before it loads.

Only the DiT's own part: ``gen_transformer.*``, ``gen_vae.*`` and ``gen_image_condition_refiner.*``
against the modules `stage_dit.pipeline.build_dit_modules` builds on ``meta`` from the ``gen_*``
configs. The AR's tensors are not looked at.
"""

from __future__ import annotations

from mammoth_core.checkpoint_check import CheckpointPart, Shapes


def expected_shapes(config: dict) -> Shapes:
    """``{"gen_transformer.": {...}, "gen_vae.": {...}, "gen_image_condition_refiner.": {...}}``:
    state-dict key -> shape of each DiT module ``config`` describes."""
    from mammoth_core.meta_build import shapes_only
    from stage_dit.pipeline import build_dit_modules

    with shapes_only():
        modules = build_dit_modules(config)
    return {f"{prefix}.": {k: tuple(v.shape) for k, v in m.state_dict().items()}
            for prefix, m in modules.named_modules_by_prefix().items()}


CHECKPOINT_PART = CheckpointPart(
    name="DiT",
    files=(),
    config_sections=("gen_dit_config", "gen_vae_config", "gen_image_condition_refiner_config"),
    expected_shapes=expected_shapes,
)
