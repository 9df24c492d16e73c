"""The README's two commands, followed in a fresh clone, work.

The command is read from README.md (the first ```bash block under "Set-up commands"), not copied
here, so editing the README changes what is tested. It runs in a fresh ``git clone`` of this
repository (the committed HEAD: uncommitted edits are not part of a fresh clone) with a fresh
``.venv``, an empty model cache (``XDG_CACHE_HOME``) and nothing from this test session's
environment that a newcomer would not have (no ``MAMMOTH_*``, no ``VIRTUAL_ENV``, no
``PYTHONPATH``). Only the first command runs: the second is the test command itself (this test is
part of it). Marked ``readme`` (deselect with ``-m 'not readme'`` for a quick local run).

The default run (``bash scripts/test.sh``) keeps the cheap equivalents; the two fresh-environment
runs take minutes each and are marked ``slow`` (``bash scripts/test.sh -m slow``, docs/TESTING.md):

* the set-up command's ``mammoth up --generate`` part runs in a fresh clone with an empty model
  cache on this session's interpreter (default run); the whole command, ``scripts/setup.sh``
  included, with a fresh ``.venv`` (``slow``; CI's own ``scripts/test.sh`` in a clean clone
  creates a fresh ``.venv`` with the test extras every run);
* the unit part's isolation: ``tests/unit/conftest.py`` gives the in-place unit run an empty
  ``HOME`` and cache and fails on a skip that is not for hardware (default run); the run of
  ``tests/unit`` in an isolated fresh clone (``slow``).

The test command's unit part runs in a second fresh clone that has nothing beside it (an empty
temporary folder, its own empty ``HOME`` and cache): 0 failures and no skip other than for missing
hardware prove that no unit test reads data from outside the repository. It runs the pytest that
``scripts/test.sh`` runs, ``python -m pytest tests/unit``, with this session's interpreter (its
installed dependencies) and the clone first on ``sys.path``: a fresh ``.venv`` would add minutes and
is what the set-up test above already proves.
"""

from __future__ import annotations

import io
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from isolation import is_hardware_skip, newcomer_env

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.readme


def setup_commands(readme: str) -> list[str]:
    """The ```bash blocks of the README's "Set-up commands" section, in order."""
    match = re.search(r"^## Set-up commands.*?$(.*?)(?=^## )", readme, re.S | re.M)
    assert match, "README.md has no '## Set-up commands' section"
    blocks = re.findall(r"```bash\n(.*?)```", match.group(1), re.S)
    return [b.strip() for b in blocks]


def test_readme_has_the_two_setup_commands():
    commands = setup_commands((ROOT / "README.md").read_text())
    assert len(commands) == 2, commands
    assert "scripts/setup.sh" in commands[0] and "mammoth up --generate" in commands[0]
    assert commands[1] == "bash scripts/test.sh"


def fresh_clone(dest: pathlib.Path) -> pathlib.Path:
    """``git clone`` of this repository's committed HEAD into ``dest`` (checked: same commit)."""
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(dest)], check=True, timeout=120)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=dest, capture_output=True,
                          text=True).stdout == head, "the clone is not of this checkout's HEAD"
    return dest


@pytest.mark.slow
def test_readme_test_command_unit_part_in_an_isolated_clone(tmp_path_factory):
    commands = setup_commands((ROOT / "README.md").read_text())
    assert commands[1] == "bash scripts/test.sh"  # which runs `.venv/bin/python -m pytest "$@"`
    assert '.venv/bin/python -m pytest "$@"' in (ROOT / "scripts" / "test.sh").read_text()
    clone = fresh_clone(tmp_path_factory.mktemp("isolated") / "mammoth-pipeline")
    assert [p.name for p in clone.parent.iterdir()] == ["mammoth-pipeline"]  # nothing beside it
    home = tmp_path_factory.mktemp("home")
    env = newcomer_env(home)
    env.update(HOME=str(home), PYTHONPATH=os.pathsep.join([str(clone), str(clone / "operator")]))
    where = subprocess.run(
        [sys.executable, "-c", "import mammoth_core, stage_ar, stage_dit, gateway; "
         "print(mammoth_core.__file__, stage_ar.__file__, stage_dit.__file__, gateway.__file__)"],
        cwd=clone, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert all(pathlib.Path(f).is_relative_to(clone) for f in where.stdout.split()), where.stdout
    report = home / "unit.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/unit", "-q", "-p", "no:cacheprovider",
         f"--junitxml={report}"],
        cwd=clone, env=env, capture_output=True, text=True, timeout=480)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, f"tests/unit failed in a fresh clone ({proc.returncode}):\n{tail}"
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert int(suite.get("failures")) == 0 and int(suite.get("errors")) == 0, tail
    assert int(suite.get("tests")) > 150, tail  # the unit tests were collected, not an empty run
    skips = [s.get("message", "") for s in suite.iter("skipped")]
    not_hardware = [m for m in skips if not is_hardware_skip(m)]
    assert not not_hardware, f"skipped for another reason than missing hardware: {not_hardware}"


#: The set-up command is ``bash scripts/setup.sh && <this part>``; the part after it is what
#: :func:`test_readme_generate_part_in_a_fresh_clone` runs without a fresh ``.venv``.
SETUP_PREFIX = "bash scripts/setup.sh && "


def test_readme_generate_part_in_a_fresh_clone(tmp_path):
    """The set-up command's ``mammoth up --generate`` part, as the README writes it, in a fresh clone
    with an empty model cache; ``.venv`` is this session's environment, the clone's code first on
    ``sys.path`` (the fresh ``.venv`` itself: the ``slow`` test below)."""
    command = setup_commands((ROOT / "README.md").read_text())[0]
    assert command.startswith(SETUP_PREFIX), command
    clone = fresh_clone(tmp_path / "clone")
    (clone / ".venv").symlink_to(pathlib.Path(sys.prefix), target_is_directory=True)
    env = newcomer_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(clone), str(clone / "operator")])
    generate = command[len(SETUP_PREFIX):]
    proc = subprocess.run(["bash", "-c", generate], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (
        f"`{generate}` failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    assert_generated(command, clone, proc.stdout)


@pytest.mark.slow
def test_readme_quick_start_in_a_fresh_clone(tmp_path):
    if shutil.which("git") is None:
        pytest.fail("git is needed to make a fresh clone")
    command = setup_commands((ROOT / "README.md").read_text())[0]
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    env = newcomer_env(tmp_path)
    # pip's own download cache stays where it is (a newcomer's pip has one too)
    env.setdefault("PIP_CACHE_DIR", os.path.expanduser("~/.cache/pip"))
    proc = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=540)
    assert proc.returncode == 0, (
        f"`{command}` failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    assert_generated(command, clone, proc.stdout)


def assert_generated(command: str, clone: pathlib.Path, stdout: str) -> None:
    """The PNG that ``command``'s ``--output`` names exists in ``clone`` at its ``--size``, and
    ``stdout`` has the banner and the "wrote" line."""
    output = re.search(r"--output (\S+)", command).group(1)
    size = re.search(r"--size (\d+)x(\d+)", command)
    from PIL import Image

    data = (clone / shlex.split(output)[0]).read_bytes()
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG" and image.size == (int(size.group(1)), int(size.group(2)))
    assert "Mammoth pipeline is up" in stdout and f"wrote {output}" in stdout
