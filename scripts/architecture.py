"""Writes docs/architecture.md from the code: the layers' import graph, a line per module, and
the policy-writing example, so the page cannot drift from what it describes.

    .venv/bin/python scripts/architecture.py           # rewrite docs/architecture.md
    .venv/bin/python scripts/architecture.py --check   # exit 1 if the page is stale

Everything is read with ``ast`` (nothing is imported), and tests/test_layout.py reuses the
same import graph for its layout rules. The hand-written prose (what each layer is for, the
data flow, the contracts) lives here, in LAYERS and the text around the generated parts.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = "cachelab"
PLUGINS = ("policies", "predictors", "traces")
PACKAGES = (CORE, *PLUGINS)
OUTPUT = "docs/architecture.md"
# The built-in policy whose whole source is the guide's example; it should use the policy
# template of cachelab.policy and stay short (about 30 lines of code below its docstring).
EXAMPLE_POLICY = "policies/linked/lru.py"
COMMAND = "scripts/architecture.py"
# The contracts between the layers, in the order of the data flow: (module path, class). The
# page lists each one's docstring summary and public methods, read from the code.
CONTRACTS = (
    ("cachelab/trace/corpus.py", "Corpus"),
    ("cachelab/trace/arrivals.py", "ArrivalSource"),
    ("cachelab/workload/lookups.py", "LookupStream"),
    ("cachelab/policy/contract.py", "Policy"),
    ("cachelab/policy/contract.py", "StepResult"),
    ("cachelab/engine/tiers.py", "Tier"),
    ("cachelab/engine/tiers.py", "Hierarchy"),
    ("cachelab/store/store.py", "TieredStore"),
    ("cachelab/learning/predictor.py", "Predictor"),
    ("cachelab/experiment/kinds.py", "ExperimentKind"),
)

# What each layer is for, in the order of the data flow. A layer the code has and this table
# lacks is still drawn and listed, under its package docstring.
LAYERS = {
    "cachelab.engram": "Addressing: token ids to Engram row ids, bit-exact with DeepSeek's reference.",
    "cachelab.trace": "Request traces: the versioned table, importers, synthesis, conversion, statistics.",
    "cachelab.workload": "What serving asks of the tables: lookup streams grouped into steps, "
                         "the future (next access, lookahead), prefix caches.",
    "cachelab.policy": "The policy contract and the public toolkit compiled policies are built from.",
    "cachelab.engine": "Tiers and their hierarchy, the replays that drive lookups through them, MRCs.",
    "cachelab.store": "The live tiered store: table files, real cache tiers driven by policies, counters.",
    "cachelab.serving": "Step times, latency, throughput and cost from lookups and tier hits.",
    "cachelab.live": "An Engram model serving real requests: torch model, paged KV cache, continuous-batching "
                     "engine, OpenAI-compatible server (`cachelab serve`).",
    "cachelab.learning": "Features, labels, causal training and the judging of learned policies.",
    "cachelab.capture": "Capture of live serving: a recording proxy, vLLM's KV-cache events, durable "
                        "segments, and a capture read back as a request trace.",
    "cachelab.bench": "Measuring live servers: the load generator, the server's own metrics, the prefix-cache check.",
    "cachelab.experiment": "Specs, grids of points, runners, backends, MLflow tracking, reports.",
    "cachelab.testing": "The conformance kit third parties run on their policies and predictors.",
    "cachelab.cli": "The command line: parse, call the library, print.",
    "policies": "Built-in policies (plug-in side, entry points `cachelab.policies`).",
    "predictors": "Built-in hotness predictors (plug-in side, entry points `cachelab.predictors`).",
    "traces": "Built-in trace producers (plug-in side, entry points `cachelab.workloads`).",
}


@dataclass(frozen=True)
class Module:
    name: str  # dotted: cachelab.engine.replay
    path: Path  # relative to the repository root
    is_package: bool

    @property
    def package(self) -> str:
        """The package relative imports start from."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the module named: the deepest module of ours, else the dotted name as written
    names: tuple[str, ...]  # names a ``from`` import takes from target (empty: the module itself)
    line: int
    runtime: bool  # False inside a function or under ``if TYPE_CHECKING:``: not run on import


def find_modules(root: Path = ROOT) -> dict[str, Module]:
    """Every module of the four packages, by dotted name."""
    out = {}
    for top in PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            parts = list(rel.with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            out[".".join(parts)] = Module(".".join(parts), rel, is_package)
    return out


def _deepest(name: str, modules) -> str:
    """The longest prefix of ``name`` that is one of our modules (``name`` if none is)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return name


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(nodes, runtime: bool):
    """Import statements with whether they run when the module is imported."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, runtime
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk(ast.iter_child_nodes(node), False)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _walk(node.body, False)
            yield from _walk(node.orelse, runtime)
        else:
            yield from _walk(ast.iter_child_nodes(node), runtime)


def module_imports(module: Module, modules, root: Path = ROOT) -> list[Import]:
    """The imports of one module, each resolved to the module it names."""
    tree = ast.parse((root / module.path).read_text(encoding="utf-8"), filename=str(module.path))
    out = []
    for node, runtime in _walk(tree.body, True):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append(Import(module.name, _deepest(alias.name, modules), (), node.lineno, runtime))
            continue
        base = node.module or ""
        if node.level:
            package = module.package.split(".")
            package = package[:len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        taken = []
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in modules:
                out.append(Import(module.name, sub, (), node.lineno, runtime))
            else:
                taken.append(alias.name)
        if taken:
            out.append(Import(module.name, _deepest(base, modules), tuple(taken), node.lineno, runtime))
    return out


def import_graph(root: Path = ROOT) -> tuple[dict[str, Module], list[Import]]:
    """All modules and all their imports."""
    modules = find_modules(root)
    return modules, [imp for m in modules.values() for imp in module_imports(m, modules, root)]


def layer_of(name: str) -> str:
    """A module's layer: its cachelab subpackage (or top-level module), or its plug-in package."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == CORE and len(parts) > 1 else parts[0]


def layer_edges(modules, imports) -> dict[str, set[str]]:
    """Layer -> the layers it imports (runtime or not), among our own packages."""
    edges = defaultdict(set)
    for imp in imports:
        if imp.target in modules and layer_of(imp.source) != layer_of(imp.target):
            edges[layer_of(imp.source)].add(layer_of(imp.target))
    return edges


def reach(edges) -> dict[str, set[str]]:
    """Node -> every node an import chain from it arrives at."""
    out = {}
    for start in edges:
        seen, todo = set(), list(edges[start])
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo += edges.get(node, ())
        out[start] = seen
    return out


def cycles(edges) -> list[list[str]]:
    """Groups of nodes that import each other, directly or through others."""
    r = reach(edges)
    groups = {frozenset([u] + [v for v in r[u] if u in r.get(v, ())]) for u in r if u in r[u]}
    return sorted(sorted(g) for g in groups)


def levels(nodes, edges) -> dict[str, int]:
    """Longest chain of imports down to a node that imports none of ours (0); the nodes of a
    cycle share one level."""
    r = reach(edges)
    same = {n: {n} | {v for v in r.get(n, ()) if n in r.get(v, ())} for n in nodes}
    memo: dict[str, int] = {}

    def level(node):
        if node not in memo:
            below = {d for m in same[node] for d in edges.get(m, ())} - same[node]
            memo[node] = max((level(d) + 1 for d in below), default=0)
            for m in same[node]:
                memo[m] = memo[node]
        return memo[node]

    return {n: level(n) for n in nodes}


def reduced(edges) -> dict[str, set[str]]:
    """The edges no longer chain implies (a transitive reduction), keeping every edge of a cycle."""
    r = reach(edges)
    out = {}
    for u, targets in edges.items():
        out[u] = {v for v in targets if u in r.get(v, ()) or not any(
            v in r.get(w, ()) and w not in r.get(v, ()) for w in targets if w != v)}
    return out


def first_paragraph(path: Path) -> str:
    """A module docstring's first paragraph, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=True)
    if not doc:
        return "(no docstring)"
    return " ".join(doc.split("\n\n")[0].split())


def contract_line(root: Path, path: str, name: str) -> str:
    """``Class`` (path): its docstring summary; its public methods and properties."""
    tree = ast.parse((root / path).read_text(encoding="utf-8"))
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    if not found:
        raise SystemExit(f"{COMMAND}: CONTRACTS names {name} in {path}, which has no such class")
    cls = found[0]
    doc = ast.get_docstring(cls, clean=True) or "(no docstring)"
    methods = [f"`{n.name}`" for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
               and not n.name.startswith("_")]
    summary = " ".join(doc.split("\n\n")[0].split())
    return f"- `{name}` ({path}): {summary}" + (f" Methods: {', '.join(methods)}." if methods else "")


def _node_id(layer: str) -> str:
    return layer.replace(".", "_")


def _mermaid(layers, edges) -> list[str]:
    lines = ["```mermaid", "flowchart BT"]
    core = sorted(l for l in layers if l.startswith(CORE))
    plugins = sorted(l for l in layers if not l.startswith(CORE))
    for key, title, group in (("core", "cachelab (the core)", core), ("plugins", "plug-ins (entry points)", plugins)):
        lines.append(f'  subgraph {key}["{title}"]')
        lines += [f'    {_node_id(l)}["{l}"]' for l in group]
        lines.append("  end")
    for src in sorted(edges):
        lines += [f"  {_node_id(src)} --> {_node_id(dst)}" for dst in sorted(edges[src])]
    return lines + ["```"]


def _ascii(layers, edges, level) -> list[str]:
    lines = ["```"]
    width = max(len(l) for l in layers)
    for lv in sorted(set(level.values()), reverse=True):
        for layer in sorted(l for l in layers if level[l] == lv):
            deps = ", ".join(d.removeprefix(f"{CORE}.") for d in sorted(edges.get(layer, ())))
            lines.append(f"{lv:>2}  {layer:<{width}}  -> {deps or '(none of ours)'}")
    return lines + ["```"]


def render(root: Path = ROOT) -> str:
    """The whole page."""
    modules, imports = import_graph(root)
    edges = layer_edges(modules, imports)
    layers = sorted({layer_of(n) for n in modules})
    level = levels(layers, edges)
    by_layer = defaultdict(list)
    for m in modules.values():
        by_layer[layer_of(m.name)].append(m)
    example = (root / EXAMPLE_POLICY).read_text(encoding="utf-8").rstrip("\n")
    order = [l for l in LAYERS if l in by_layer] + [l for l in layers if l not in LAYERS]

    out = [
        "# Architecture",
        "",
        f"<!-- Generated by {COMMAND} from the code: do not edit by hand; run",
        f"     `.venv/bin/python {COMMAND}` after changing a module, an import or the example. -->",
        "",
        "cachelab is one pipeline in visible layers. Text and request arrivals become a request",
        "trace (`cachelab.trace`); a scheduler and the prefix cache turn the trace's requests into",
        "serving steps, and the Engram addresser (`cachelab.engram`) turns each step's tokens into",
        "row lookups (`cachelab.workload`); a hierarchy of tiers, each run by a policy",
        "(`cachelab.policy`), serves those lookups (`cachelab.engine`); the latency model turns",
        "each step's hits and bytes into time, throughput and cost (`cachelab.serving`); learned",
        "predictors score rows from causal features (`cachelab.learning`); experiments sweep all",
        "of it and track it in MLflow (`cachelab.experiment`); the CLI (`cachelab.cli`) only",
        "parses, calls the library and prints.",
        "",
        "The same policies also run on real bytes and real requests. The live store",
        "(`cachelab.store`) keeps the Engram tables in files and serves each step's lookups through",
        "tiers of real rows, each run by a policy; the live engine (`cachelab.live`) serves an",
        "Engram model over HTTP (`cachelab serve`) and fetches its rows through that store; the",
        "capture (`cachelab.capture`) records live serving through a proxy in front of any",
        "OpenAI-compatible server, and reads a capture back as a request trace; the load generator (`cachelab.bench`)",
        "replays a trace against a live server as `vllm bench serve` does; and the latency model is",
        "fitted to the live engine's step logs (`cachelab.serving`, `cachelab calibrate`).",
        "",
        "The plug-in side (`policies/`, `predictors/`, `traces/`) imports only cachelab's public",
        "modules, and the core never imports it by name: it finds every built-in through the",
        "entry points of `pyproject.toml` (`cachelab.registry`), exactly as it finds a third",
        "party's plug-in. The groups are `cachelab.policies`, `cachelab.predictors`, `cachelab.workloads`",
        "and `cachelab.experiment_kinds`, whose built-in kinds live in the core (`cachelab.experiment`).",
        "tests/test_layout.py holds the code to these rules, to no cycle of",
        "module-level imports between modules and to no module over 600 lines. Layers may still",
        "import each other, through other modules or imports inside functions: the groups that do",
        "are listed below.",
        "",
        "## Layers and their imports",
        "",
        "An arrow runs from a layer to a layer it imports, computed with `ast` over every module",
        "(imports inside functions count too). The picture leaves out an arrow that a longer chain",
        "of arrows already implies; the levels below list every direct import.",
        "",
        *_mermaid(layers, reduced(edges)),
        "",
        "The same graph as levels: a layer's level is the longest chain of imports below it (0:",
        "it imports no layer of ours); layers that import each other share a level.",
        "",
        *_ascii(layers, edges, level),
        "",
        "Layers that import each other (through any chain, lazy imports included): "
        + ("; ".join(", ".join(f"`{n}`" for n in group) for group in cycles(edges)) or "none") + ".",
        "",
        "## Contracts",
        "",
        "What one layer hands the next, in the order of the data flow (each class's summary and",
        "public methods, read from the code):",
        "",
        *[contract_line(root, path, name) for path, name in CONTRACTS],
        "",
        "## Modules",
        "",
        "Each module's path and the first paragraph of its docstring, by layer.",
        "",
    ]
    for layer in order:
        purpose = LAYERS.get(layer)
        out.append(f"### `{layer}`" + (f": {purpose}" if purpose else ""))
        out.append("")
        for m in sorted(by_layer[layer], key=lambda m: m.path.as_posix()):
            out.append(f"- `{m.path.as_posix()}`: {first_paragraph(root / m.path)}")
        out.append("")
    out += [
        "## Writing a policy",
        "",
        "A policy is one cache tier's admission and eviction, one serving step at a time",
        "(`cachelab.policy`'s contract). Built-ins are written exactly as a third party's would be,",
        "against cachelab's public toolkit, and registered by an entry point. The whole source of",
        f"the built-in `{EXAMPLE_POLICY}` ({len(example.splitlines())} lines), embedded here from the file:",
        "",
        "```python",
        example,
        "```",
        "",
        "Register it under `[project.entry-points.\"cachelab.policies\"]` in your package's",
        "`pyproject.toml`, run the conformance kit (`cachelab.testing.check_policy`), and",
        "`cachelab policies list` shows it. The full guide, the pure-Python contract and the",
        "plug-in packaging are in [docs/plugins.md](plugins.md); the built-ins and their",
        "validation are in [docs/policies.md](policies.md).",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    page = render()
    target = ROOT / OUTPUT
    if "--check" in argv:
        if target.read_text(encoding="utf-8") != page:
            print(f"{OUTPUT} is stale: run .venv/bin/python {COMMAND}", file=sys.stderr)
            return 1
        return 0
    target.write_text(page, encoding="utf-8")
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
