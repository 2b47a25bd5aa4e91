"""Every module the repository imports comes from a distribution that pyproject.toml declares by
name, in the extra of the folder that imports it: checked by reading every import (lazy ones too)
and asking the environment which distribution provides it. A package that only arrives through
another one's dependencies (httpx through an old openai) fails here, not on a user's fresh
machine. Then every module of the repository is imported, as a fresh environment built from the
README's install line must allow."""

import ast
import functools
import importlib
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SKIP_DIRS = {".venv", "build", "dist", ".git", "__pycache__", ".pytest_cache"}
# The extras each top-level folder may import from, beyond the core dependencies. Data packages
# that `fly-serve bench` reads without importing (find_spec only) are not imports.
EXTRAS_OF = {
    "fly_serve": ["models"],  # weights.py assembles the default pair (gguf, accelerate); llama_runner.py, lazily
    "deployments": [],
    "fly_cli": ["models"],
    "fly_bench": ["models", "bench"],
    "loadtest": ["models", "test", "bench"],  # load_sweep plots with matplotlib
    "scripts": ["bench"],  # cross_node.py reads the app over HTTP (requests), as fly_bench does
    "tests": ["models", "test", "bench"],
}


# Files that may also import from an extra the README's install leaves out; such a package is
# checked by name (its import name is its distribution's), as it is not installed here.
EXTRA_EXTRAS: dict[str, list[str]] = {}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    return norm(re.match(r"[A-Za-z0-9._-]+", req.strip()).group(0))


def declared(folder: str, extras: tuple[str, ...] = ()) -> set[str]:
    project = PYPROJECT["project"]
    reqs = list(project["dependencies"])
    for extra in [*EXTRAS_OF[folder], *extras]:
        reqs += project["optional-dependencies"][extra]
    return {requirement_name(r) for r in reqs}


@functools.cache
def python_files() -> list[Path]:
    out = []
    for folder in EXTRAS_OF:
        out += [p for p in (ROOT / folder).rglob("*.py") if not SKIP_DIRS & set(p.parts)]
    return sorted(out)


@functools.cache
def first_party() -> set[str]:
    """Our own top-level names: the packages, and the modules that sit beside a script or test."""
    return set(EXTRAS_OF) | {p.stem for p in python_files()}


def imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def undeclared(path: Path, folder: str, providers: dict[str, list[str]]) -> list[str]:
    """What `path` (in `folder`) imports that no declared distribution provides."""
    optional = tuple(EXTRA_EXTRAS.get(path.relative_to(ROOT).as_posix(), ())) if path.is_relative_to(ROOT) else ()
    allowed, out = declared(folder), []
    for name in sorted(imported_names(path) - first_party() - set(sys.stdlib_module_names)):
        dists = {norm(d) for d in providers.get(name, [])}
        if not dists and norm(name) in declared(folder, optional) - allowed:
            continue  # an optional extra's package, not installed by the README: declared by name
        if not dists:
            out.append(f"{path.name}: imports {name}, which no installed distribution provides")
        elif not dists & allowed:
            where = f"core + {EXTRAS_OF[folder]}"
            out.append(f"{path.name}: imports {name} (from {', '.join(sorted(dists))}), declared in none of {where}")
    return out


def test_every_import_is_declared_in_pyproject():
    providers = md.packages_distributions()
    problems = [p for path in python_files() for p in undeclared(path, path.relative_to(ROOT).parts[0], providers)]
    assert not problems, "\n".join(problems)


PACKAGES = ("fly_serve", "deployments", "fly_cli", "fly_bench", "loadtest")
# Locust monkey-patches the whole process through gevent when it is imported: not in a test process.
NOT_IMPORTED = {"loadtest.locustfile", "loadtest.load_sweep"}


def module_names() -> list[str]:
    out = []
    for path in python_files():
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(p for p in rel.parts if p != "__init__")
        if rel.parts[0] in PACKAGES and name not in NOT_IMPORTED:
            out.append(name)
    return out


@pytest.mark.parametrize("module", module_names())
def test_every_package_module_imports(module):
    """Importing runs each module's top level: a missing package, or an API a pinned version
    removed, shows here."""
    importlib.import_module(module)


def test_the_check_sees_a_missing_declaration(tmp_path):
    """The check is not vacuous: a lazy import of a package that is installed only as another's
    dependency (urllib3, which requests pulls in) is reported for a folder that does not declare
    it, and one that is not installed at all is reported too."""
    providers = md.packages_distributions()
    src = tmp_path / "probe.py"
    src.write_text("import torch\n\ndef f():\n    import urllib3\n    from no_such_package_here import x\n")
    problems = undeclared(src, "fly_serve", providers)
    assert len(problems) == 2, problems
    assert "urllib3" in problems[1] and "no_such_package_here" in problems[0]
