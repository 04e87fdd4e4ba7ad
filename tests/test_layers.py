"""The package's layers import only downward, and the broker, the client and ``mlxq tail``
work where MLX is not installed (docs/architecture.md).

Layers, bottom first: ``wire``; ``engine`` (its own parts in order: the base modules, then
``models``, ``constraints``, ``slots``, ``distributed``, and last the modules that assemble
an engine); ``broker``; ``worker``; ``formats``; ``api``; ``cli``. Every import counts,
a function-level one too: a lazy import is a dependency all the same.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mlxq"
LAYERS = ["wire", "engine", "broker", "worker", "formats", "api", "cli"]
# Inside the engine: what every part uses, then the parts, then what assembles them.
ENGINE_ASSEMBLY = {"factory", "runner", "mlx_lm_batch"}
ENGINE_PARTS = ["models", "constraints", "slots", "distributed"]
# Top-level modules any layer may use (they import nothing of mlxq's), and those that sit
# above the layers they use (the embedded server, the client, the public serializer path).
BASE = {"errors", "logs", "orphans", "jobs"}
TOP_LEVEL_RANK = {"server": 2.5, "serializer": 2.5, "client": 4.5, "__main__": 7}


def rank(module: str) -> tuple[float, float]:
    """Where a module sits: (layer, rank within the engine)."""
    parts = module.split(".")[1:]
    if not parts or parts[0] in BASE:
        return (-1, 0)
    if parts[0] in TOP_LEVEL_RANK:
        return (TOP_LEVEL_RANK[parts[0]], 0)
    layer = LAYERS.index(parts[0])
    if parts[0] != "engine" or len(parts) == 1:
        return (layer, 0)
    sub = parts[1]
    if sub in ENGINE_PARTS:
        return (layer, 1 + ENGINE_PARTS.index(sub))
    return (layer, 1 + len(ENGINE_PARTS) if sub in ENGINE_ASSEMBLY else 0)


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imported(path: Path, package: str) -> set[str]:
    """The mlxq modules a file imports, anywhere in it (relative imports resolved)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("mlxq")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            if not base.startswith("mlxq"):
                continue
            out |= {f"{base}.{a.name}" for a in node.names} | {base}
    return out


def test_every_import_goes_down_the_layers():
    known = modules()
    upward = []
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for target in imported(path, package):
            while target not in known and "." in target:  # `from m import name`: m
                target = target.rsplit(".", 1)[0]
            if target == name or target not in known:
                continue
            if rank(target) > rank(name):
                upward.append(f"{name} imports {target}")
    assert not upward, "\n".join(sorted(set(upward)))


def test_no_import_circle():
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for target in imported(path, package):
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name and not known[target].name == "__init__.py":
                deps.add(target)
        graph[name] = deps
    seen: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(node: str, trail: list[str]) -> list[str] | None:
        seen[node] = 1
        for dep in sorted(graph[node]):
            if seen.get(dep) == 1:
                return [*trail, node, dep]
            if dep not in seen and (cycle := visit(dep, [*trail, node])):
                return cycle
        seen[node] = 2
        return None

    for start in sorted(graph):
        if start not in seen and (cycle := visit(start, [])):
            pytest.fail("import circle: " + " -> ".join(cycle[cycle.index(cycle[-1]) :]))


NO_MLX = """
import importlib, pkgutil, sys

class NoMLX:
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("mlx", "mlx_lm"):
            raise ImportError(f"No module named {name!r} (MLX is not installed here)")
        return None

sys.meta_path.insert(0, NoMLX())
import mlxq.broker
for info in pkgutil.walk_packages(mlxq.broker.__path__, "mlxq.broker."):
    importlib.import_module(info.name)
import mlxq.client, mlxq.wire
from mlxq.cli.main import cli
cli(["tail", "--help"])
"""


def test_the_broker_the_client_and_mlxq_tail_need_no_mlx():
    done = subprocess.run(
        [sys.executable, "-c", NO_MLX], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Usage: " in done.stdout and "tail" in done.stdout


def test_the_data_path_names_modules_that_exist():
    """docs/data-path.md walks one request through the code: every module it names is
    there, and the stops are numbered in order."""
    text = (ROOT / "docs" / "data-path.md").read_text()
    named = set(re.findall(r"`(mlxq/[\w/]+\.py)`", text))
    assert len(named) >= 20, named
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, missing
    stops = [int(n) for n in re.findall(r"^(\d+)\. ", text, re.M)]
    assert stops == list(range(1, len(stops) + 1)), stops
