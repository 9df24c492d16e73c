"""``mammoth check-checkpoint DIR``: validate a whole checkpoint in seconds, without a GPU.

Every component's part (`stage_ar.checkpoint_part`, `stage_dit.checkpoint_part`) through
`mammoth_core.checkpoint_check.check_parts`, strictly: a tensor under no component's prefix is a
problem too. The stages check only their own part before they load (``verify_parts``).
"""

from __future__ import annotations

import os

from mammoth_core.checkpoint_check import CheckReport, check_parts


def check_checkpoint(path: str | os.PathLike) -> CheckReport:
    """Validate the checkpoint folder ``path`` for both stages; never raises for a bad checkpoint
    (see the report's ``problems``)."""
    from stage_ar.checkpoint_part import CHECKPOINT_PART as AR_PART
    from stage_dit.checkpoint_part import CHECKPOINT_PART as DIT_PART

    return check_parts(path, [AR_PART, DIT_PART], strict_prefixes=True)
