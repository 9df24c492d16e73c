"""The ``mammoth`` help pages as a new user reads them: plain text, a description on every page."""

from __future__ import annotations

import argparse

from mammoth_app.cli import build_parser


def _pages() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"mammoth": parser, **{f"mammoth {name}": page for name, page in sub.choices.items()}}


def test_help_pages_show_no_markup_and_no_empty_default():
    for name, page in _pages().items():
        text = page.format_help()
        assert "``" not in text, (name, text[:300])
        assert "(default: )" not in " ".join(text.split()), (name, text)
    seed = " ".join(_pages()["mammoth make-checkpoint"].format_help().split())
    assert "seed of the random weights (default: 0)" in seed, seed  # a default of 0 is a default


def test_every_command_page_says_what_the_command_does():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for choice in sub._choices_actions:
        page = sub.choices[choice.dest]
        assert page.description, f"mammoth {choice.dest} --help has no description"
