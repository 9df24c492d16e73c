"""The README's set-up command, followed literally in a fresh clone, works.

The command is read from README.md (the first ```bash block under "Set-up commands"), not copied
here, so editing the README changes what is tested. It runs in a fresh ``git clone`` of this
repository (the committed HEAD: uncommitted edits are not part of a fresh clone) with a fresh
``.venv``, an empty model cache (``XDG_CACHE_HOME``) and nothing from this test session's
environment that a newcomer would not have (no ``MAMMOTH_*``, no ``VIRTUAL_ENV``, no
``PYTHONPATH``). Only the first command runs: the second is the test command itself (this test is
part of it). Marked ``readme`` (deselect with ``-m 'not readme'`` for a quick local run).
"""

from __future__ import annotations

import io
import os
import pathlib
import re
import shlex
import shutil
import subprocess

import pytest

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


def test_readme_quick_start_in_a_fresh_clone(tmp_path):
    if shutil.which("git") is None:
        pytest.fail("git is needed to make a fresh clone")
    command = setup_commands((ROOT / "README.md").read_text())[0]
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MAMMOTH_", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "CONDA"))}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # no built-in checkpoint from earlier runs
    # pip's own download cache stays where it is (a newcomer's pip has one too)
    env.setdefault("PIP_CACHE_DIR", os.path.expanduser("~/.cache/pip"))
    proc = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=540)
    assert proc.returncode == 0, (
        f"`{command}` failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")

    output = re.search(r"--output (\S+)", command).group(1)
    size = re.search(r"--size (\d+)x(\d+)", command)
    from PIL import Image

    data = (clone / shlex.split(output)[0]).read_bytes()
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG" and image.size == (int(size.group(1)), int(size.group(2)))
    assert "Mammoth pipeline is up" in proc.stdout and f"wrote {output}" in proc.stdout
