"""docs/CONFIGURATION.md is generated from the CRD and the settings dataclasses and cannot drift."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import shutil

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "scripts" / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_up_to_date():
    gen = _generator()
    assert (ROOT / "docs" / "CONFIGURATION.md").read_text() == gen.render(), (
        "docs/CONFIGURATION.md is out of date: run python scripts/gen_config_reference.py")


def test_reference_names_every_setting_and_every_crd_field():
    from mammoth_core import settings

    text = _generator().render()
    for cls in (settings.ARSettings, settings.DiTSettings, settings.GatewaySettings):
        for f in dataclasses.fields(cls):
            assert f"`--{f.name.replace('_', '-')}`" in text and f"`MAMMOTH_{f.name.upper()}`" in text, f.name
            assert f.metadata.get("help", "").split("(")[0].strip()[:40] in text, f.name

    crd = yaml.safe_load(next((ROOT / "charts" / "mammoth-operator" / "crds").glob("*.yaml")).read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]

    def walk(node, path):
        for name, child in (node.get("properties") or {}).items():
            assert f"`{path}.{name}`" in text, f"{path}.{name}"
            walk(child, f"{path}.{name}")

    walk(spec, "spec")


def test_a_changed_crd_description_is_caught(tmp_path, monkeypatch):
    gen = _generator()
    crds = tmp_path / "crds"
    shutil.copytree(ROOT / "charts" / "mammoth-operator" / "crds", crds)
    path = next(crds.glob("*.yaml"))
    path.write_text(path.read_text().replace("Hidden-state rows per chunk message.", "Rows per chunk."))
    monkeypatch.setattr(gen, "CRD_DIR", crds)
    assert gen.main(["--check"]) == 1
