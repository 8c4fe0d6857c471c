"""The layout rules of issue 13, read from the code with ``ast`` (nothing is imported): no import
cycle, no module over 600 lines, the core never imports the plug-in side, the plug-in side
imports only cachelab's public modules, docs cite only files a clone contains, and
docs/architecture.md is what scripts/architecture.py writes today."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600
_SEGMENT = r"(?:[\w.*-]|\{[\w.*,-]*\})+"  # a path part; {a,b} is a brace expansion
CITED = re.compile(rf"(?<![\w./~{{}}-])((?:\.\.?/)*{_SEGMENT}(?:/{_SEGMENT})*\.(?:py|toml|md))(?![\w/-])")
BRACES = re.compile(r"\{([^{}]*)\}")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+")


def _load_generator():
    spec = importlib.util.spec_from_file_location("architecture", ROOT / "scripts" / "architecture.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


arch = _load_generator()
MODULES, IMPORTS = arch.import_graph(ROOT)


def _top(name: str) -> str:
    return name.split(".")[0]


def _cycle_path(group: set[str], edges: dict[str, set[str]]) -> list[str]:
    """One concrete cycle through a group of mutually importing modules, for the message."""
    start = min(group)
    path, node = [start], start
    while True:
        node = min(n for n in edges[node] if n in group)
        if node in path:
            return path[path.index(node):] + [node]
        path.append(node)


def test_architecture_page_is_generated_from_the_code():
    committed = (ROOT / arch.OUTPUT).read_text(encoding="utf-8")
    assert committed == arch.render(ROOT), (
        f"{arch.OUTPUT} is stale: regenerate it with `.venv/bin/python {arch.COMMAND}` and commit it")


def _cycles(imports) -> list[str]:
    """Each cycle among ``imports`` (of our modules) as one line: a -> b -> a."""
    edges: dict[str, set[str]] = {}
    for imp in imports:
        if imp.target in MODULES and imp.target != imp.source:
            edges.setdefault(imp.source, set()).add(imp.target)
    return [" -> ".join(_cycle_path(set(g), edges)) for g in arch.cycles(edges)]


def test_no_import_cycle():
    found = _cycles(imp for imp in IMPORTS if imp.runtime)
    assert not found, "import cycles (module-level imports):\n" + "\n".join(found)


def _in_functions(module) -> set[int]:
    """The lines of the imports a module runs inside its functions (lazily)."""
    tree = ast.parse((ROOT / module.path).read_text(encoding="utf-8"))
    return {node.lineno for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(f) if isinstance(node, (ast.Import, ast.ImportFrom))}


def test_no_import_cycle_hidden_by_an_import_in_a_function():
    """An import in a function runs all the same, on the first call: a cycle it closes is one the
    module-level check does not see (what both ends share belongs in a module both import at the
    top). Imports under TYPE_CHECKING never run and stay out."""
    lazy = {m.name: _in_functions(m) for m in MODULES.values()}
    found = _cycles(imp for imp in IMPORTS if imp.runtime or imp.line in lazy[imp.source])
    assert not found, "import cycles through an import in a function:\n" + "\n".join(found)


def test_no_module_over_600_lines():
    sizes = {m.path.as_posix(): len((ROOT / m.path).read_text(encoding="utf-8").splitlines())
             for m in MODULES.values()}
    over = sorted(f"{path}: {n} lines" for path, n in sizes.items() if n > MAX_LINES)
    assert not over, f"modules over {MAX_LINES} lines:\n" + "\n".join(over)


def _named_imports(module) -> list[tuple[str, int]]:
    """Modules a file imports by a literal string (importlib.import_module, __import__)."""
    tree = ast.parse((ROOT / module.path).read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__"):
                out.append((node.args[0].value, node.lineno))
    return out


def test_core_never_imports_the_plugin_side():
    bad = [f"{MODULES[i.source].path}:{i.line}: imports {i.target}" for i in IMPORTS
           if _top(i.source) == arch.CORE and _top(i.target) in arch.PLUGINS]
    bad += [f"{m.path}:{line}: imports {name!r} by name" for m in MODULES.values() if _top(m.name) == arch.CORE
            for name, line in _named_imports(m) if _top(name) in arch.PLUGINS]
    assert not bad, "the core finds plug-ins through cachelab.registry, never by name:\n" + "\n".join(bad)


def _private(dotted: str) -> bool:
    return any(part.startswith("_") for part in dotted.split("."))


def test_plugins_import_only_cachelab_public_modules():
    """Public: a module of cachelab that exists, with no underscore-prefixed part, and names
    taken from it that are not underscore-prefixed. Plug-in packages never import each other."""
    bad = []
    for imp in IMPORTS:
        home, top = _top(imp.source), _top(imp.target)
        where = f"{MODULES[imp.source].path}:{imp.line}"
        if home not in arch.PLUGINS or top == home:
            continue
        if top in arch.PLUGINS:
            bad.append(f"{where}: imports {imp.target}, another plug-in package")
        elif top == arch.CORE:
            if imp.target not in MODULES:
                bad.append(f"{where}: imports {imp.target}, which is no module of cachelab")
            elif _private(imp.target):
                bad.append(f"{where}: imports the private module {imp.target}")
            bad += [f"{where}: imports the private name {imp.target}.{n}" for n in imp.names if n.startswith("_")]
    assert not bad, "plug-ins use only cachelab's public API:\n" + "\n".join(bad)


def _clone_files() -> set[str]:
    """What a clone of this checkout holds: tracked files and new files git does not ignore."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return set(out.splitlines())


def _expand(cited: str) -> list[str]:
    """``a/{b,c}.py`` -> ``a/b.py``, ``a/c.py``."""
    match = BRACES.search(cited)
    if not match:
        return [cited]
    return [p for alt in match[1].split(",") for p in _expand(cited[:match.start()] + alt + cited[match.end():])]


def _resolves(cited: str, doc: Path, files: set[str]) -> bool:
    """A path resolves relative to the repository root or to the citing document (as a Markdown
    link does). A bare name is checked only for a document (``NAME.md``, the name of some file of
    the clone): a bare ``.py`` or ``.toml`` name is as often a file the reader writes."""
    if "/" not in cited:
        return not cited.endswith(".md") or any(Path(f).name == cited for f in files)
    for base in (ROOT, doc.parent):
        path = (base / cited).resolve()
        if not path.is_relative_to(ROOT):
            continue
        rel = path.relative_to(ROOT).as_posix()
        if rel in files or ("*" in rel and any(Path(f).match(rel) for f in files if f.count("/") == rel.count("/"))):
            return True
    return False


def _citations(text: str) -> list[tuple[int, str]]:
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        out += [(number, m) for m in LINK.findall(line) if not URL.match(m) and not m.startswith("mailto:")]
        bare = URL.sub(" ", line)
        out += [(number, m) for m in CITED.findall(bare)]
    return out


DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_cite_only_files_a_clone_contains(doc):
    files = _clone_files()
    text = doc.read_text(encoding="utf-8")
    missing = sorted({f"{doc.relative_to(ROOT)}:{n}: {path}" for n, cited in _citations(text)
                      for path in _expand(cited) if not _resolves(path, doc, files)})
    assert not missing, "cited files that a clone does not contain (cite the clone's path or a public URL):\n" + \
        "\n".join(missing)


MACHINE_PATH = re.compile(r"(?:^|[^\w.~/-])(/(?:work|root|home)/[\w.-]+)")


def test_no_file_names_a_path_of_a_working_machine():
    """A clone runs anywhere: commands and docs name paths relative to the repository root or
    a temporary directory, never the directories of the machine a change was made on."""
    found = []
    for rel in _clone_files():
        path = ROOT / rel
        if rel.startswith("tests/golden/") or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"{rel}:{n}: {m}" for n, line in enumerate(text.splitlines(), 1) for m in MACHINE_PATH.findall(line)]
    assert not found, "paths of a working machine:\n" + "\n".join(found)
