"""Validation of settings values by pydantic: each settings dataclass field's type hint and
metadata (``choices``, bounds ``ge``/``gt``/``le``/``lt``) become a field of a pydantic model
derived once per class, which turns raw values (strings from flags and the environment, YAML
scalars and lists) into typed ones or names every bad one (`validate_values`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from typing import Annotated, Any, Literal, Mapping

import pydantic

from mammoth_core.small_files import read_small_file


class SettingsError(ValueError):
    """A setting has an invalid value or type; the message names the setting and its source."""


#: The largest stage token file read (a token is a line of a few dozen characters).
TOKEN_FILE_MAX_BYTES = 64 * 1024
#: The largest YAML settings file read.
CONFIG_FILE_MAX_BYTES = 1024 * 1024


def read_settings_file(path: str | os.PathLike, limit: int, what: str) -> str:
    """The UTF-8 text of a file a setting names (`mammoth_core.small_files.read_small_file`: a regular
    file, or a pipe its writer finishes in time, of at most ``limit`` bytes, opened without blocking).

    Raises:
        SettingsError: naming ``path``: neither a regular file nor a pipe, a pipe not finished in time,
            larger than ``limit``, not UTF-8.
        OSError: the file cannot be opened or read.
    """
    try:
        return read_small_file(path, limit, what).decode("utf-8")
    except ValueError as exc:  # UnicodeDecodeError is one
        raise SettingsError(str(exc) if not isinstance(exc, UnicodeDecodeError)
                            else f"{os.fspath(path)}: not UTF-8 text ({exc.reason})") from None


def _split_commas(value: Any) -> Any:
    """``"a:1, b:2"`` (a flag or environment value) -> ``["a:1", "b:2"]``; anything else as is."""
    return [v for v in (p.strip() for p in value.split(",")) if v] if isinstance(value, str) else value


def _none_words(value: Any) -> Any:
    """``""``, ``"none"``, ``"null"`` (any case) -> None; anything else as is."""
    return None if isinstance(value, str) and value.strip().lower() in ("", "none", "null") else value


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a number, not a boolean")
    return value


def _annotation(hint: Any, meta: Mapping[str, Any]) -> Any:
    """The pydantic type of a field: its type hint with the metadata's choices and bounds."""
    bounds = {k: meta[k] for k in ("ge", "gt", "le", "lt") if k in meta}
    base = Literal[tuple(meta["choices"])] if "choices" in meta else hint
    optional = type(None) in typing.get_args(hint)
    if typing.get_origin(hint) is list:
        base = Annotated[hint, pydantic.BeforeValidator(_split_commas)]
    if hint in (int, float):
        base = Annotated[base, pydantic.BeforeValidator(_not_a_bool)]
    if bounds:
        base = Annotated[base, pydantic.Field(**bounds)]
    return Annotated[base, pydantic.BeforeValidator(_none_words)] if optional else base


@functools.cache
def _values_model(cls: type) -> type[pydantic.BaseModel]:
    """A pydantic model with one optional field per settings field of ``cls`` (type, choices,
    bounds): validates the values given, any subset of the fields."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: (_annotation(hints[f.name], f.metadata), None) for f in dataclasses.fields(cls)}
    config = pydantic.ConfigDict(extra="forbid", coerce_numbers_to_str=True)
    return pydantic.create_model(f"{cls.__name__}Values", __config__=config, **fields)


def validate_values(cls: type, values: Mapping[str, tuple[Any, str]]) -> dict[str, Any]:
    """``name -> (raw value, source)`` -> ``name -> typed value``.

    Raises:
        SettingsError: naming every bad value: ``setting 'slots' from env MAMMOTH_SLOTS: '0' is
            invalid (Input should be greater than or equal to 1)``, one such line per value.
    """
    try:
        model = _values_model(cls).model_validate({k: v for k, (v, _) in values.items()})
    except pydantic.ValidationError as exc:
        lines = []
        for err in exc.errors():
            name = str(err["loc"][0])
            raw, source = values[name]
            why = err["msg"].removeprefix("Value error, ")
            lines.append(f"setting {name!r} from {source}: {raw!r} is invalid ({why})")
        raise SettingsError("; ".join(dict.fromkeys(lines))) from None
    return {k: getattr(model, k) for k in values}


def check_fields(settings: Any) -> None:
    """Validate every field's value of ``settings`` against its type, choices and bounds.

    Raises:
        SettingsError: naming each bad value (source ``value``).
    """
    values = {f.name: (getattr(settings, f.name), "value") for f in dataclasses.fields(settings)}
    validate_values(type(settings), values)
