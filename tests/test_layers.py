"""The package's layers, as docs/architecture.md draws them: kernels <- models <- core <-
structured <- worker <- spec_decode <- engine <- server / cli / bench / llm. Checked on the
import graph of every `import` in braid (lazy ones inside functions included), and by
importing the core in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A module may import from its own layer's packages only where the layer is
# shared ground (the base, the top); otherwise from its own package or a lower layer.
LAYERS = [
    {"braid.files", "braid.sampling_params", "braid.outputs", "braid.config",
     "braid.tokenizer", "braid.messages", "braid.heap", "braid.bad_words"},
    {"braid.kernels"},
    {"braid.models"},
    {"braid.core"},
    {"braid.structured"},
    {"braid.worker"},
    {"braid.spec_decode"},
    {"braid.engine"},
    {"braid.llm", "braid.server", "braid.cli", "braid.bench", "braid"},
]
SHARED = (0, len(LAYERS) - 1)


def modules() -> dict[str, Path]:
    found = {}
    for path in (ROOT / "braid").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the braid modules it imports (a name imported from a package counts as its
    submodule where one exists, else as the package)."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            else:
                continue
            for target in targets:
                while target not in mods and "." in target:
                    target = target.rpartition(".")[0]
                if target in mods and target != name:
                    found.add(target)
        graph[name] = found
    return graph


def package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def layer(module: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if package(module) in names)


def test_every_package_has_a_layer() -> None:
    missing = {package(m) for m in modules()} - set().union(*LAYERS)
    assert not missing, f"packages without a layer in LAYERS: {sorted(missing)}"


def test_imports_go_down_the_layers() -> None:
    wrong = []
    for module, targets in imports(modules()).items():
        for target in targets:
            a, b = layer(module), layer(target)
            if b > a or (b == a and a not in SHARED and package(module) != package(target)):
                wrong.append(f"{module} (layer {a}) imports {target} (layer {b})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycles() -> None:
    graph = imports(modules())
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_the_core_imports_no_torch_and_nothing_above_it() -> None:
    core = sorted(m for m in modules() if package(m) == "braid.core")
    code = ("import sys\n" + "".join(f"import {m}\n" for m in core) +
            "print(' '.join(sorted(m for m in sys.modules if m == 'torch' or "
            "m.startswith(('torch.', 'braid')))))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = result.stdout.split()
    assert "torch" not in loaded
    above = [m for m in loaded if m != "braid" and layer(m) > layer("braid.core")]
    assert not above, f"braid.core imports {above}"
