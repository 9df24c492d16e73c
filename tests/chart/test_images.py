"""The four Dockerfiles: hadolint-clean, multi-stage, non-root, and installing what each needs.

No image is built here (no Docker engine): the release workflow builds them. What can be decided
from the files is checked here, with the real hadolint and the real import graph of the code.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import chart_tools
from chart_tools import DOCKERFILES, REPO_ROOT, parse_dockerfile, pip_installs, \
    project_extras_installed, run

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
TORCH_PIN = next(r for r in PYPROJECT["project"]["optional-dependencies"]["ar"] if r.startswith("torch"))

# What each image runs (docs/KUBERNETES.md, the images table): the extras it installs, its ports, its command.
# The stage images carry both stage extras: a builtin://tiny source is made in the pod, which builds
# both stages' models (the `mammoth` command's make_checkpoint, in mammoth_app).
IMAGES = {
    "ar": {"extras": {"ar", "dit"}, "cuda": True, "ports": {"50051", "9091"},
           "packages": ["stage_ar", "mammoth_app/make_checkpoint.py"]},
    "dit": {"extras": {"ar", "dit"}, "cuda": True, "ports": {"50052", "9092"},
            "packages": ["stage_dit", "mammoth_app/make_checkpoint.py"]},
    "gateway": {"extras": {"gateway"}, "cuda": False, "ports": {"8000"}, "packages": ["gateway"]},
    "operator": {"extras": {"operator"}, "cuda": False, "ports": {"8080"},
                 "packages": ["operator/mammoth_operator"]},
}
FIRST_PARTY = {"mammoth_core", "stage_ar", "stage_dit", "gateway", "mammoth_operator", "mammoth_app"}
FIRST_PARTY_DIRS = {"mammoth_core": "mammoth_core", "stage_ar": "stage_ar", "stage_dit": "stage_dit",
                    "gateway": "gateway", "mammoth_operator": "operator/mammoth_operator",
                    "mammoth_app": "mammoth_app"}
#: the model stack: in the stage extras only; the gateway and operator images install none of it
MODEL_STACK = {"torch", "diffusers", "safetensors", "tiktoken", "triton"}
RUNTIME_TOOLS = {"ar": {"gcc", "libc6-dev", "python3.12-dev"}}
BUILD_TOOLS = re.compile(r"\b(gcc|g\+\+|clang|make|cmake|build-essential|[\w.+-]+-dev|git|curl|wget)\b")


def test_every_dockerfile_exists_and_is_hadolint_clean(hadolint):
    for name, path in DOCKERFILES.items():
        assert path.is_file(), f"{path.name} is missing"
        proc = run([hadolint, "--config", REPO_ROOT / ".hadolint.yaml", "--no-color", path])
        assert proc.returncode == 0 and proc.stdout.strip() == "", \
            f"{path.name}:\n{proc.stdout}{proc.stderr}"


def test_hadolint_configuration_really_bites(hadolint, tmp_path):
    """The same config flags a careless Dockerfile (so a clean run above means something)."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM quay.io/someone/python:latest\nRUN pip install requests\n"
                   "RUN apt-get update && apt-get install -y gcc\nCMD python\n")
    proc = run([hadolint, "--config", REPO_ROOT / ".hadolint.yaml", "--no-color", bad])
    assert proc.returncode != 0
    for rule in ("DL3007", "DL3013", "DL3008", "DL3015", "DL3026", "DL3025"):
        assert rule in proc.stdout, proc.stdout


def test_every_hadolint_ignore_is_explained():
    config = yaml.safe_load((REPO_ROOT / ".hadolint.yaml").read_text())
    assert config.get("ignored") in (None, []), "global ignores hide findings in every file"
    for path in DOCKERFILES.values():
        lines = path.read_text().splitlines()
        for index, line in enumerate(lines):
            if re.match(r"#\s*hadolint\s+ignore=", line.strip()):
                above = lines[index - 1].strip() if index else ""
                assert above.startswith("#") and "hadolint" not in above and len(above) > 20, \
                    f"{path.name}:{index + 1}: ignore without an explanation above it"


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_is_multi_stage_non_root_and_runs_mammoth(image):
    spec = IMAGES[image]
    global_args, stages = parse_dockerfile(DOCKERFILES[image])
    assert len(stages) >= 2, "multi-stage: a build stage and a lean final stage"
    final = stages[-1]
    # pinned base: an explicit version tag (or digest), never latest
    for stage in stages:
        if stage.base.split(":")[0] in {s.name for s in stages if s.name}:
            continue
        assert re.search(r"(:\d+(\.\d+)+[\w.-]*|@sha256:[0-9a-f]{64})$", stage.base), stage.base
        assert ":latest" not in stage.base
        if spec["cuda"]:
            assert stage.base.startswith("nvidia/cuda:"), stage.base
    [user] = final.arguments("USER")[-1:]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root USER (runAsNonRoot needs a number)"
    chart_values = yaml.safe_load((chart_tools.CHART_DIR / "values.yaml").read_text())
    assert int(uid) == chart_values["podSecurityContext"]["runAsUser"]
    assert final.arguments("ENTRYPOINT") == ['["mammoth"]']
    cmd = final.arguments("CMD")
    assert cmd and cmd[-1].startswith(f'["{image}"')
    exposed = {p for arg in final.arguments("EXPOSE") for p in arg.split()}
    assert exposed == spec["ports"]
    # the final stage builds nothing: no pip, no compilers, no -dev packages; the one exception is
    # what Triton compiles its launchers with at run time in the AR image (gcc, libc and Python
    # headers: the decode-attention kernel and torch.compile's kernels), and nothing else
    allowed = RUNTIME_TOOLS.get(image, set())
    for argument in final.arguments("RUN"):
        assert "pip install" not in argument and "pip3 install" not in argument
        found = {m.group(0) for m in BUILD_TOOLS.finditer(argument.replace("--no-install-recommends", ""))}
        assert found <= allowed, f"{argument}: {sorted(found - allowed)}"
    if allowed:
        assert any(allowed <= set(a.split()) for a in final.arguments("RUN")), allowed
        env = " ".join(final.arguments("ENV"))
        assert "TRITON_HOME=/var/cache/mammoth" in env  # the writable cache volume, not $HOME
    assert any("--from=build" in a and "/opt/mammoth" in a for a in final.arguments("COPY"))


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_torch_is_pinned_and_comes_from_the_right_pytorch_index(image):
    global_args, stages = parse_dockerfile(DOCKERFILES[image])
    build = stages[0]
    installs = pip_installs(build, global_args)
    torch_steps = [args for args in installs if any(a.startswith("torch") for a in args)]
    if not IMAGES[image]["cuda"]:
        assert torch_steps == [], f"{image} runs no model: no torch ({installs})"
        return
    assert len(torch_steps) == 1, installs
    args = torch_steps[0]
    assert TORCH_PIN in args, f"torch must be pinned like pyproject ({TORCH_PIN}): {args}"
    index = args[args.index("--index-url") + 1]
    flavour = index.rstrip("/").rsplit("/", 1)[-1]
    if IMAGES[image]["cuda"]:
        assert re.fullmatch(r"cu1\d{2}", flavour), index
        assert index.startswith("https://download.pytorch.org/whl/")
    # torch goes in before the project, so the project's `torch==` pin finds it satisfied
    project_step = next(i for i, a in enumerate(installs) if "." in a or any(x.startswith(".[") for x in a))
    assert installs.index(args) < project_step
    pip_pins = [a for args in installs for a in args if a.startswith("pip")]
    assert pip_pins and all(re.fullmatch(r"pip==[\d.]+", a) for a in pip_pins)


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_installs_the_extras_its_component_needs(image):
    global_args, stages = parse_dockerfile(DOCKERFILES[image])
    installed = set()
    for stage in stages:
        extras = project_extras_installed(stage, global_args)
        if extras is not None:
            installed |= extras
    assert installed == IMAGES[image]["extras"], \
        f"{image} installs extras {sorted(installed)}, needs {sorted(IMAGES[image]['extras'])}"
    declared = set(PYPROJECT["project"]["optional-dependencies"])
    assert installed <= declared


def _imports(tree: ast.AST, module_level_only: bool) -> set[str]:
    """Absolute module names imported by a module (optionally only at module level)."""
    names: set[str] = set()

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            func = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            guarded = isinstance(child, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                for h in child.handlers)
            type_checking = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            if guarded or type_checking:
                continue  # optional imports: not a requirement
            if isinstance(child, ast.Import) and not (module_level_only and in_function):
                names.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module \
                    and not (module_level_only and in_function):
                names.add(child.module)
            visit(child, in_function or func)

    visit(tree, False)
    return names


def _module_file(module: str) -> Path | None:
    top, *rest = module.split(".")
    base = REPO_ROOT / FIRST_PARTY_DIRS[top]
    for candidate in (base.joinpath(*rest).with_suffix(".py"), base.joinpath(*rest, "__init__.py")):
        if candidate.is_file():
            return candidate
    return None


def third_party_imports(packages: list[str]) -> set[str]:
    """Top-level third-party modules the component needs.

    Every import of the component's own package counts (it runs all of it); other first-party
    modules are followed through their module-level imports only (a function-level import there
    is how shared code keeps an extra optional, e.g. the CLI importing the gateway lazily).
    """
    needed: set[str] = set()
    seen: set[Path] = set()
    queue: list[tuple[Path, bool]] = [(p, False) for pkg in packages
                                      for p in ([REPO_ROOT / pkg] if pkg.endswith(".py")
                                                else (REPO_ROOT / pkg).rglob("*.py"))]
    while queue:
        path, module_level_only = queue.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports(ast.parse(path.read_text(), str(path)), module_level_only):
            top = name.split(".")[0]
            if top in FIRST_PARTY:
                for prefix in [name.rsplit(".", i)[0] for i in range(name.count(".") + 1)]:
                    target = _module_file(prefix)
                    if target:
                        queue.append((target, True))
            elif top not in sys.stdlib_module_names and top != "__future__":
                needed.add(top)
    return needed


def distributions_of(requirements: list[str], extras: set[str]) -> set[str]:
    """Canonical names of the distributions a set of requirements installs (transitively)."""
    environment = default_environment()
    todo = [Requirement(r) for r in requirements]
    found: set[str] = set()
    while todo:
        req = todo.pop()
        env = dict(environment, extra="")
        if req.marker and not any(req.marker.evaluate(dict(env, extra=e)) for e in ("", *extras)):
            continue
        name = canonicalize_name(req.name)
        if name == canonicalize_name(PYPROJECT["project"]["name"]):
            for extra in req.extras:
                todo.extend(Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][extra])
            continue
        if name in found:
            continue
        found.add(name)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        for sub in requires:
            sub_req = Requirement(sub)
            if sub_req.marker and not any(sub_req.marker.evaluate(dict(env, extra=e)) for e in ("", *req.extras)):
                continue
            todo.append(sub_req)
    return found


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_dependencies_cover_every_import_of_its_component(image):
    """The core deps plus the image's extras provide every third-party module the code imports."""
    spec = IMAGES[image]
    modules = third_party_imports(spec["packages"])
    requirements = list(PYPROJECT["project"]["dependencies"])
    for extra in spec["extras"]:
        requirements += PYPROJECT["project"]["optional-dependencies"][extra]
    provided = distributions_of(requirements, spec["extras"])
    owners = metadata.packages_distributions()
    missing = {}
    for module in sorted(modules):
        dists = {canonicalize_name(d) for d in owners.get(module, [])}
        if not dists:
            missing[module] = "not installed in the test environment"
        elif not dists & provided:
            missing[module] = f"from {sorted(dists)}, not in the image's requirements"
    assert missing == {}, f"{image}: {missing}"


@pytest.mark.parametrize("image", ["gateway", "operator"])
def test_the_gateway_and_operator_requirements_hold_no_model_stack(image):
    """`pip install .[gateway]` / `.[operator]`: no torch, diffusers, ... among the distributions."""
    extras = IMAGES[image]["extras"]
    requirements = list(PYPROJECT["project"]["dependencies"])
    for extra in extras:
        requirements += PYPROJECT["project"]["optional-dependencies"][extra]
    assert distributions_of(requirements, extras) & MODEL_STACK == set()
    assert third_party_imports(IMAGES[image]["packages"]) & MODEL_STACK == set()


def test_dependency_check_notices_a_missing_extra():
    """Without the gateway extra the gateway's imports (FastAPI) are not covered."""
    modules = third_party_imports(["gateway"])
    provided = distributions_of(list(PYPROJECT["project"]["dependencies"]), set())
    owners = metadata.packages_distributions()
    assert "fastapi" in modules
    assert not {canonicalize_name(d) for d in owners["fastapi"]} & provided


def test_dockerignore_keeps_the_context_small_but_complete():
    ignored = [line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for must in (".git", ".cache", "tests", "charts/*"):
        assert must in ignored
    # the one file of charts/ re-included: the CRD, which the operator validates specs with
    assert [line for line in ignored if line.startswith("!")] == ["!charts/mammoth-operator", "!charts/mammoth-operator/crds"]
    copied = set()
    for path in DOCKERFILES.values():
        for stage in parse_dockerfile(path)[1]:
            for argument in stage.arguments("COPY"):
                if not argument.startswith("--from"):
                    copied.update(argument.split()[:-1])
    for source in copied:
        top = source.rstrip("/").split("/")[0]
        assert top not in ignored, f"{source} is COPYed but .dockerignore drops it"
        assert (REPO_ROOT / source).exists(), f"{source} is COPYed but does not exist"
    # setuptools needs every package of pyproject's list in the context
    for package in PYPROJECT["tool"]["setuptools"]["packages"]:
        top = PYPROJECT["tool"]["setuptools"].get("package-dir", {}).get(package, package.replace(".", "/"))
        assert any(top == c.rstrip("/") or top.startswith(c.rstrip("/") + "/") for c in copied), package
