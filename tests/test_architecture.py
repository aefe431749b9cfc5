"""The house rules, checked on the code: the planner side imports no torch, imports run down the
floors of the map in docs/architecture.md, and each package's face names what the others use."""

import ast
import graphlib
import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "flopwise"
# the torch-free side: `flopwise plan`, `scale` and `audit` run on a laptop without loading torch
PLANNER = ["config/", "hardware/", "files/", "layout/", "plan/", "scale/", "flops.py", "errors.py", "log.py"]
# every sub-package but the CLI has a face (its __init__.py: HOMES, __all__, a lazy __getattr__)
FACES = sorted(p.parent.name for p in SRC.glob("*/__init__.py") if p.parent.name != "cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


@cache
def tree(name: str) -> ast.Module:
    return ast.parse(MODULES[name].read_text(encoding="utf-8"))


def imported(name: str) -> list[tuple[str, list[str]]]:
    """Each flopwise import in module `name`, function-level ones too: (the module named, the names)."""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree(name)):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.split(".")[0] == "flopwise"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package `level - 1` steps above this module's
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            if base.split(".")[0] == "flopwise":
                out.append((base, [a.name for a in node.names]))
    return out


@cache
def imports(name: str) -> set[str]:
    """The flopwise modules `name` imports (a name imported from a module counts as that module)."""
    found = set()
    for base, names in imported(name):
        for target in [f"{base}.{n}" for n in names] or [base]:
            while target not in MODULES:
                target = target.rpartition(".")[0]
            found.add(target)
    return found - {name}


@cache
def floors() -> list[list[str]]:
    """The map's floors, top first: each a list of entries (`pkg/`, `module.py`, `pkg/module.py`)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    found = re.search(r"^```floors\n(.*?)^```", text, re.M | re.S)
    assert found, "docs/architecture.md: no ```floors block"
    lines = [line.split("#")[0].split() for line in found.group(1).splitlines()]
    return [line for line in lines if line]


def covers(entry: str, rel: str) -> bool:
    """Whether the map's `entry` places the file `rel`: a module itself; a package (`pkg/`) every
    module inside it, or the one module `pkg.py` it may also be (the CLI, while it is one file)."""
    return entry == rel or (entry.endswith("/") and (rel.startswith(entry) or rel == f"{entry[:-1]}.py"))


def exists(entry: str) -> bool:
    if entry.endswith("/"):
        return (SRC / entry).is_dir() or (SRC / f"{entry[:-1]}.py").is_file()
    return (SRC / entry).is_file()


@cache
def unit_of(name: str) -> str:
    """The map's entry that places module `name`: the most specific one covering its file."""
    rel = MODULES[name].relative_to(SRC).as_posix()
    covering = [e for line in floors() for e in line if covers(e, rel)]
    assert covering, f"docs/architecture.md's map places no entry for {rel}"
    return max(covering, key=len)


@cache
def level(entry: str) -> int:
    return next(len(floors()) - i for i, line in enumerate(floors()) if entry in line)


def test_the_map_names_every_module_and_nothing_else():
    entries = [e for line in floors() for e in line]
    assert len(entries) == len(set(entries)), "an entry is on two floors"
    assert [e for e in entries if not exists(e)] == []
    for name in MODULES:
        unit_of(name)


def test_no_module_imports_from_a_floor_above_it():
    upward = [
        f"{name} ({unit_of(name)}) imports {target} ({unit_of(target)}), a floor above"
        for name in MODULES
        for target in sorted(imports(name))
        if level(unit_of(target)) > level(unit_of(name))
    ]
    assert upward == []


def test_imports_form_no_loop():
    """No two modules import each other, directly or round a loop; nor do the rooms of one floor."""
    graphlib.TopologicalSorter({name: imports(name) for name in MODULES}).prepare()
    rooms: dict[str, set[str]] = {}
    for name in MODULES:
        unit = unit_of(name)
        same_floor = {unit_of(t) for t in imports(name) if level(unit_of(t)) == level(unit)}
        rooms.setdefault(unit, set()).update(same_floor - {unit})
    graphlib.TopologicalSorter(rooms).prepare()


def planner_modules() -> list[str]:
    return ["flopwise"] + [
        name for name in MODULES if any(covers(e, unit_of(name)) or unit_of(name).startswith(e) for e in PLANNER)
    ]


def test_the_planner_side_imports_no_torch():
    """Every module of the planner's floors, and every name its faces list, imported in a fresh
    process: torch is not among the modules loaded (and neither is the engine's side)."""
    faces = [f"flopwise.{e[:-1]}" for e in PLANNER if e.endswith("/")]
    code = (
        "import importlib, json, sys\n"
        "modules, faces = json.loads(sys.argv[1]), json.loads(sys.argv[2])\n"
        "for m in modules: importlib.import_module(m)\n"
        "for f in faces: [getattr(importlib.import_module(f), n) for n in importlib.import_module(f).__all__]\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC.parent), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, "-c", code, json.dumps(planner_modules()), json.dumps(faces)]
    r = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


def face(package: str) -> tuple[dict[str, list[str]], list[str]]:
    """A face's HOMES and __all__, read from its source (importing it is cheap, but this is cheaper)."""
    found = {}
    for node in tree(f"flopwise.{package}").body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id] = node.value
    homes = ast.literal_eval(found["HOMES"])
    return homes, [n for names in homes.values() for n in names]


def defined(name: str) -> set[str]:
    """The names module `name` defines at its top level (not the ones it imports)."""
    out = set()
    for node in tree(name).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out


@pytest.mark.parametrize("package", FACES)
def test_each_face_lists_names_its_modules_define(package):
    import importlib

    module = importlib.import_module(f"flopwise.{package}")
    homes, names = face(package)
    assert module.__doc__ and module.__doc__.strip(), f"{package}/__init__.py: a docstring says the room's purpose"
    assert module.__all__ == names and len(names) == len(set(names))
    submodules = {p.stem for p in (SRC / package).glob("*.py")}
    assert [n for n in names if n in submodules] == [], "a public name that is also a module's is shadowed by it"
    for home, listed in homes.items():
        assert home in submodules, f"flopwise.{package}: no module {home}"
        assert sorted(set(listed) - defined(f"flopwise.{package}.{home}")) == [], f"not defined in {package}/{home}.py"


def test_code_outside_a_package_imports_only_what_its_face_lists():
    """Inside flopwise, a name is imported from its home module, never from a face, and from another
    package only if that package's face lists it (so `__all__` is the whole of its public API)."""
    public = {package: set(face(package)[1]) for package in FACES}
    wrong = []
    for name in MODULES:
        mine = name.split(".")[1] if "." in name else None
        for base, names in imported(name):
            parts = base.split(".")
            if len(parts) < 2 or parts[1] not in public or parts[1] == mine:
                continue
            if len(parts) == 2:
                wrong += [f"{name}: from {base} import {n} (a face)" for n in names if f"{base}.{n}" not in MODULES]
            else:
                wrong += [f"{name}: from {base} import {n}" for n in names if n not in public[parts[1]]]
    assert wrong == []
