"""The folders show the layers, and the imports keep to them (read from the source with ast, every
import, also those inside functions and under TYPE_CHECKING):

    prl/config/        the typed config tree                     imports nothing else of prl
    prl/run/           the run protocol: run directory, lifecycle, the programs' contracts
    prl/inference/, prl/orchestrator/, prl/trainer/, prl/envs/   the programs (and environments)
    prl/control/       the control plane: `prl` on a login node   never imports a program

A layer imports its own and lower layers only; programs do not import each other, except that the
orchestrator runs the environments. No import cycle, no two modules of one name outside prl/config
(its modules are named after the config sections: config/slurm.py is the `slurm:` section). Each
package's docstring names exactly the modules that are there.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRL = ROOT / "prl"
RANK = {"config": 0, "run": 1, "envs": 2, "inference": 2, "orchestrator": 2, "trainer": 2, "control": 3}
ALSO_ALLOWED = {("orchestrator", "envs")}


def modules() -> dict[str, Path]:
    out = {}
    for path in PRL.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The prl modules `path` imports (a `from pkg import name` of a module counts as that module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("prl")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("prl"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known}
    return {m for m in found if m in known}


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(p, known) - {m} for m, p in known.items()}


def test_every_module_is_in_a_layer():
    """Only the package's own __init__ sits at the top."""
    loose = [m for m in modules() if m != "prl" and layer(m) not in RANK]
    assert not loose, f"modules outside the layer packages: {loose}"


def test_imports_keep_to_the_layers():
    wrong = []
    for module, targets in graph().items():
        src = layer(module)
        for target in targets:
            dst = layer(target)
            if src is None or dst is None or src == dst or (src, dst) in ALSO_ALLOWED:
                continue
            if RANK[dst] >= RANK[src]:
                wrong.append(f"{module} imports {target} ({src} may not use {dst})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(g[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [m, t]) if t in stack else f"{m} -> {t}")
            elif t not in state:
                visit(t, stack + [m])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [])
    assert not cycles, "\n".join(cycles)


def test_no_two_modules_of_one_name():
    names: dict[str, list[str]] = {}
    for module, path in modules().items():
        if layer(module) not in (None, "config") and path.name != "__init__.py":
            names.setdefault(path.stem, []).append(module)
    assert not {n: ms for n, ms in names.items() if len(ms) > 1}


def test_the_control_plane_imports_neither_torch_nor_vllm():
    """Every module of prl/control (and the config it reads) imports without torch, vllm, transformers,
    verifiers or matplotlib (`prl plot` imports it when it draws): `prl submit/status/logs` start fast
    on a login node."""
    control = sorted(m for m in modules() if layer(m) in ("control", "config"))
    code = (f"import sys; import {', '.join(control)}; "
            "heavy = [m for m in ('torch', 'vllm', 'transformers', 'verifiers', 'matplotlib') if m in sys.modules]; "
            "print(heavy); sys.exit(1 if heavy else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout + r.stderr


def named_modules(docstring: str) -> list[str]:
    """The module files a package docstring names (`name.py`, not a path such as jobs/trainer.py)."""
    return re.findall(r"(?<![\w/.])([A-Za-z_]\w*)\.py\b", docstring)


def test_named_modules_reads_names_not_paths():
    doc = "    torchrun jobs/trainer.py RUN/config.yaml\n\n    train.py   the loop\n    rank.py    a rank (see train.py)\n"
    assert named_modules(doc) == ["train", "rank", "train"]


def test_every_package_docstring_names_exactly_its_modules():
    """A folder's opening docstring is true: it names each module that is there (one line each says
    what it holds) and none that is not."""
    wrong = []
    for init in sorted(PRL.glob("*/__init__.py")):
        there = {p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py"}
        named = set(named_modules(ast.get_docstring(ast.parse(init.read_text())) or ""))
        if missing := sorted(there - named):
            wrong.append(f"{init.relative_to(ROOT)} does not name {missing}")
        if gone := sorted(named - there):
            wrong.append(f"{init.relative_to(ROOT)} names {gone}, which are not there")
    assert not wrong, "\n".join(wrong)
