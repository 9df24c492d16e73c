"""A benchmark run as independent sections: one section's exception is recorded, the others still run."""

from __future__ import annotations

import traceback
from typing import Callable, Iterable


def run_sections(res: dict, sections: Iterable[Callable[[], None] | None], save: Callable[[], None]) -> None:
    """Call each of ``sections`` (None entries are skipped); after each, ``save()`` the partial
    results. An exception's traceback goes to ``res["errors"]`` and stdout, and the next section runs."""
    for section in sections:
        if section is None:
            continue
        try:
            section()
        except Exception:  # noqa: BLE001 - keep the other sections
            res.setdefault("errors", []).append(traceback.format_exc())
            print(traceback.format_exc(), flush=True)
        save()
