"""Which keys of a YAML settings file no component reads (`unknown_config_keys`), for the warning
`mammoth_core.settings.resolve_settings` logs and for the operator's ConfigMap check.
"""

from __future__ import annotations

import dataclasses
import difflib
import os

import yaml

__all__ = ["unknown_config_keys"]


def unknown_config_keys(path: str | os.PathLike) -> list[str]:
    """Keys of a YAML settings file that no component reads, each with a suggestion when one is close.

    A flat key is known when any of `ARSettings`, `DiTSettings`, `GatewaySettings` has it; a key in
    an ``ar:``/``dit:``/``gateway:`` section when that component has it; a key in an ``operator:``
    section never (no component reads it: the operator takes flags and ``MAMMOTH_OPERATOR_*``).
    Returns lines such as ``"'slot' (did you mean 'slots'?)"`` or ``"gateway.prot (did you mean 'port'?)"``.
    """
    from mammoth_core.settings import ARSettings, DiTSettings, GatewaySettings  # settings imports this module

    from mammoth_core.settings_values import CONFIG_FILE_MAX_BYTES, read_settings_file

    data = yaml.safe_load(read_settings_file(path, CONFIG_FILE_MAX_BYTES, "a settings file")) or {}
    if not isinstance(data, dict):
        return []
    classes = {c.section: {f.name for f in dataclasses.fields(c)} for c in (ARSettings, DiTSettings, GatewaySettings)}
    everything = set().union(*classes.values())
    found = []

    def check(key: str, known: set[str], shown: str) -> None:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            found.append(shown + (f" (did you mean {close[0]!r}?)" if close else ""))

    for key, value in data.items():
        if key in classes and isinstance(value, dict):
            for sub in value:
                check(str(sub), classes[key], f"{key}.{sub}")
        elif key == "operator" and isinstance(value, dict):
            found += [f"operator.{sub} (no component reads an operator: section)" for sub in value]
        else:
            check(str(key), everything, repr(key))
    return found
