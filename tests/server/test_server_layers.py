"""The serving pod's layers hold: server -> frontend -> messages <- engine -> model ->
kernels, nothing importing upward and no import circle in `pagefleet_serve`
(`python -m pytest tests/server/test_server_layers.py` shows any that creep in); the API
side loads none of the engine core, the model code or the kernels; the shared vocabulary
and the messages load without torch."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "servingpod" / "pagefleet_serve"

# What each layer may import. `top` (the package's lazy __init__, the CLI and the offline
# `LLM`) puts the others together; `shared` is what both sides of the seam compile
# constraints with; `base` is torch-free data and vocabulary at the bottom.
MAY_IMPORT = {
    "top": {"top", "server", "frontend", "engine", "model", "kernels", "shared", "base"},
    "server": {"server", "frontend", "shared", "base"},
    "frontend": {"frontend", "shared", "base"},
    "engine": {"engine", "model", "kernels", "shared", "base"},
    "model": {"model", "kernels", "base"},
    "kernels": {"kernels", "base"},
    "shared": {"shared", "base"},
    "base": {"base"},
}
# Imports inside a function that cross a layer on purpose, each run at one moment only.
CROSSINGS = {
    # The spawned child's entry point imports the core in the child, never here.
    ("pagefleet_serve.frontend.process_link", "pagefleet_serve.engine.core_process"),
    # The frontend's tokenizer, resolved like the model (and a GGUF's vocabulary looked
    # for), loaded while the core loads the model.
    ("pagefleet_serve.frontend.tokenizer", "pagefleet_serve.model.loader.resolve"),
    ("pagefleet_serve.frontend.tokenizer", "pagefleet_serve.model.loader.gguf_file"),
    # The model's generation_config.json, found (resolved like the model) at start-up.
    ("pagefleet_serve.frontend.generation_defaults", "pagefleet_serve.model.loader.resolve"),
    # A vision-language model's preprocessor configs, found the same way at start-up.
    ("pagefleet_serve.frontend.vision", "pagefleet_serve.model.loader.resolve"),
    # `serve --headless` (a node other than rank 0's) runs engine ranks and no server: the
    # import happens in that process only, after the flags are checked.
    ("pagefleet_serve.server.serve", "pagefleet_serve.engine.executor.headless"),
}


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "pagefleet_kernels":
        return "kernels"
    sub = parts[1] if len(parts) > 1 else ""
    if module in (
        "pagefleet_serve.model_uri",
        "pagefleet_serve.structured.constraint",
        "pagefleet_serve.structured.thinking",
    ):
        # torch-free: the URI parser the operator uses, a constraint's and a thinking's data
        return "base"
    return {
        "": "top",
        "cli": "top",
        "llm": "top",
        "server": "server",
        "frontend": "frontend",
        "reasoning": "frontend",  # the output pipeline's split of a reasoning model's text
        "engine": "engine",
        "model": "model",
        "attention": "model",
        "structured": "shared",
    }.get(sub, "base")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    if not name.startswith("pagefleet_serve."):
        return False
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, when the module loads) for each import of our packages in `path`;
    an import in a function or under `if TYPE_CHECKING:` runs later or never."""
    tree = ast.parse(path.read_text())
    nested = {
        id(node)
        for scope in ast.walk(tree)
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef))
        or (isinstance(scope, ast.If) and ast.unparse(scope.test).endswith("TYPE_CHECKING"))
        for node in ast.walk(scope)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from package import submodule` imports the submodule.
            names = [
                f"{node.module}.{alias.name}"
                if is_module(f"{node.module}.{alias.name}")
                else node.module
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            if name.split(".")[0] in ("pagefleet_serve", "pagefleet_kernels"):
                found.append((name, id(node) not in nested))
    return found


def graph() -> dict[str, list[tuple[str, bool]]]:
    return {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_nothing_imports_up_the_layers():
    upward = []
    for module, targets in graph().items():
        for target, _ in targets:
            if layer(target) not in MAY_IMPORT[layer(module)] and (module, target) not in CROSSINGS:
                upward.append(f"{module} ({layer(module)}) -> {target} ({layer(target)})")
    assert upward == []


def test_every_crossing_is_still_there():
    """An allowed crossing that no longer exists is a stale exception: drop it."""
    edges = {(m, t) for m, targets in graph().items() for t, _ in targets}
    assert edges >= CROSSINGS


def test_no_import_circle():
    modules = graph()
    edges = {
        m: sorted({t for t, top in targets if top and t in modules and t != m})
        for m, targets in modules.items()
    }
    circles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in edges[module]:
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in edges:
        if module not in state:
            visit(module, [module])
    assert circles == []


def loaded_after(code: str) -> list[str]:
    """`sys.modules` of a fresh interpreter after running `code`."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_api_side_loads_no_engine_core_model_code_or_kernels():
    api_modules = [
        module_name(p)
        for folder in ("server", "frontend")
        for p in sorted((PACKAGE / folder).rglob("*.py"))
    ]
    assert "pagefleet_serve.server.openai_api" in api_modules
    assert "pagefleet_serve.frontend.core_client" in api_modules
    loaded = loaded_after("\n".join(f"import {m}" for m in api_modules))
    assert "pagefleet_serve.server.openai_api" in loaded
    forbidden = [
        m
        for m in loaded
        if m.startswith(("pagefleet_serve.engine", "pagefleet_kernels"))
        or m == "pagefleet_serve.model"
        or m.startswith("pagefleet_serve.model.")
    ]
    assert forbidden == []


@pytest.mark.parametrize("module", ["pagefleet_serve.messages", "pagefleet_serve.config"])
def test_the_shared_vocabulary_loads_without_torch(module):
    loaded = loaded_after(f"import {module}")
    assert module in loaded
    assert "torch" not in loaded
