"""Text rules shared by the gateway and the AR stage."""

from __future__ import annotations

import unicodedata

#: Unicode categories that draw nothing: controls, format characters (zero-width space/joiners,
#: BOM, bidi marks), separators.
_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Zs", "Zl", "Zp"})
#: Letters and symbols that render blank although their category is not one of the above.
_BLANK_CHARACTERS = frozenset("\u115f\u1160\u3164\uffa0\u2800")


def is_blank(text: str) -> bool:
    """True when ``text`` has no visible character: only whitespace, control and format
    characters (e.g. U+200B ZERO WIDTH SPACE, U+FEFF), separators or blank fillers (U+3164)."""
    return all(
        ch.isspace() or ch in _BLANK_CHARACTERS or unicodedata.category(ch) in _INVISIBLE_CATEGORIES
        for ch in text
    )
