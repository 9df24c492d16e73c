"""Fixtures of the chaos suite (helpers live in `chaos_harness`, a uniquely named module, so that
``from conftest import ...`` in other test folders never picks this file up)."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from chaos_harness import Cluster  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Mark every test of this folder ``chaos``."""
    here = pathlib.Path(__file__).parent
    for item in items:
        if pathlib.Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.chaos)


@pytest.fixture
def cluster(tiny_checkpoint, tmp_path):
    """A `Cluster`: component processes started by the test, all killed at teardown."""
    c = Cluster(tiny_checkpoint, tmp_path)
    yield c
    c.close()
