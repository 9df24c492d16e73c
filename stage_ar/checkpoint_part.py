"""What the AR stage reads from a checkpoint (`CHECKPOINT_PART`): checked before it loads.

Only the AR's own part: ``llm_model.*`` (vision tower skipped) against `MammothARForCausalLM`
built on ``meta`` from ``llm_config``, the generation config keys and tokenizer files it reads. The
DiT's tensors are not looked at, so this needs no DiT code (nor diffusers).
"""

from __future__ import annotations

from mammoth_core.checkpoint import AR_PREFIX, GENERATION_CONFIG_FILE, TOKENIZER_FILES
from mammoth_core.checkpoint_check import CheckpointPart, Shapes


def expected_shapes(config: dict) -> Shapes:
    """``{"llm_model.": {state-dict key: shape}}`` of the AR model ``config["llm_config"]`` describes
    (with its ``quantization_config``, `stage_ar.fp8.stores_fp8`: the visual-token projections' FP8
    codes and their ``weight_scale`` rows).

    Raises:
        ValueError: a ``quantization_config`` the AR cannot load.
    """
    from mammoth_core.meta_build import shapes_only
    from stage_ar.fp8 import stores_fp8
    from stage_ar.modeling_mammoth_ar import MammothARForCausalLM

    with shapes_only():
        model = MammothARForCausalLM.from_llm_config(config["llm_config"])
        if stores_fp8(config["llm_config"]):
            for linear in model.visual_token_linears():
                linear.hold_fp8()
    return {AR_PREFIX: {k: tuple(v.shape) for k, v in model.state_dict().items()}}


CHECKPOINT_PART = CheckpointPart(
    name="AR",
    files=(GENERATION_CONFIG_FILE, *TOKENIZER_FILES),
    config_sections=("llm_config",),
    expected_shapes=expected_shapes,
    generation_keys=("eol_token_id", "visual_token_start_id", "visual_token_end_id"),
    nonempty_files=("mammothu.tiktoken",),
)
