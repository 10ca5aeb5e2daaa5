"""embshard's import graph: no cycles, every import pointing down the layers, the planner torch-free, every
third-party package declared. The graph is read from the source (ast, nothing imported).

Edges: every `import a.b` / `from a import b` of embshard's modules: at module level, inside try/if blocks, inside
`if TYPE_CHECKING:` (a cycle for the reader and the type checker even if not at run time) and inside functions
(lazy: a cycle all the same, only deferred). Importing a module also imports its packages (`from
embshard.spec.plan import X` runs `embshard/spec/__init__.py` first), so those count too, except the importer's own
packages (already being imported) where it only passes through them; a module that reads a name off its own
package (`from embshard.kernels import fused_cross_entropy` inside embshard/kernels/) depends on that package's
__init__ having run, which is a cycle if the __init__ imports it.

Cycles are checked at two levels: modules (`embshard.planner.search`), and packages, where every module of a
sub-package counts as the package (`embshard.collection`) and the modules of embshard/ stand for themselves;
the package level leaves out the marked upward imports (below), which close a cycle of packages by design.

Layers, lowest first (`LAYERS`): a module may import its own layer or lower ones. An import from a lower layer to
a higher one is allowed only where its statement carries a comment `# upward: <why>`, and at most
`MAX_UPWARD` such imports exist. The package root (`embshard/__init__.py`: its lazy `__getattr__` is the public
API's door to ShardedEmbeddingBagCollection) and the command line (`embshard.cli`) are the top layer.

bench/ is read the same way as modules `bench.<file>`: `from bench.x import y`, relative imports, and the plain
`import x` / `from x import y` of a sibling file of the importer (the scripts' own imports).

    python tests/test_imports.py   # prints the cycles, the upward imports and bench's cycles, each edge at file:line

Declared dependencies: every third-party package that embshard imports (at module level or lazily inside a
function) is declared in pyproject.toml (`dependencies` or the `gpu` extra, so that `pip install -e .[gpu]` brings
it) and pinned in requirements/ (what `make install` installs on CPU machines); the packages tests/ imports are in
the `gpu` extra too (the GPU test suite runs after `pip install -e .[gpu]`).
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import paths
import pytest

ROOT = paths.ROOT
LAYERS = (
    "spec", "planner", "config", "data", "runtime", "lookup", "kernels", "rawids", "sharding", "twod", "collection",
    "retrieval", "models", "checkpoint", "training", "interop", "serving", "tools", "cli",
)  # fmt: skip
"""embshard's layers, lowest first: `embshard.<layer>` and its modules; the last, `cli`, also holds the package root."""
TOP = {"embshard": "cli", "embshard.cli": "cli"}
MAX_UPWARD = 2
"""The most imports from a lower layer to a higher one (each marked `# upward: <why>`)."""
UPWARD = re.compile(r"\bupward:\s*\S")
TORCH_FREE = ("spec", "planner")
"""Layers that run without the GPU stack: they import nothing of TORCH_STACK at module level."""
TORCH_STACK = {"torch", "triton", "fbgemm_gpu", "torchrec"}
Edges = dict[str, set[str]]


@dataclass(frozen=True)
class Import:
    """One imported module of one import statement."""

    source: str  # the importing module
    target: str  # the imported module (its packages are imported too: `Graph`)
    path: Path
    line: int
    lazy: bool  # inside a function
    type_only: bool  # inside `if TYPE_CHECKING:`
    note: str  # the statement's comments

    def where(self) -> str:
        kind = " (lazy)" if self.lazy else " (TYPE_CHECKING)" if self.type_only else ""
        return f"{self.path.relative_to(ROOT)}:{self.line}{kind}"


@functools.cache
def modules(top: str = "embshard") -> dict[str, Path]:
    """Dotted name -> file of every module under the folder `top` (a package is its __init__.py)."""
    out = {}
    for path in sorted((ROOT / top).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _names(node: ast.Import | ast.ImportFrom, here: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    """The dotted names an import statement may import: `import a.b` -> a.b; `from a import b` -> a.b, else a;
    relative imports resolved against `here`."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = here.split(".")
        anchor = parts[: len(parts) - node.level + (1 if is_package else 0)]
        base = ".".join([*anchor, *([base] if base else [])])
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def _module(name: str, known: dict[str, Path]) -> str:
    """The module of `known` that a dotted name is or lies in (`embshard.x.y` where y is a name: embshard.x), or ''."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def targets(
    node: ast.Import | ast.ImportFrom, here: str, is_package: bool, known: dict[str, Path], siblings: bool = False
) -> list[str]:
    """The modules of `known` an import statement names. `siblings`: a plain `import x` / `from x import y` may
    also name the file x.py next to the importer (a script's own imports, as in bench/)."""
    tops = {k.split(".")[0] for k in known}
    folder = here if is_package else here.rpartition(".")[0]
    out = []
    for name in _names(node, here, is_package, known):
        if siblings and not getattr(node, "level", 0) and name.split(".")[0] not in tops:
            name = _module(f"{folder}.{name}", known)
            name = name if name.startswith(f"{folder}.") else ""  # not a sibling: a third-party module
        else:
            name = _module(name, known)
        if name:
            out.append(name)
    return out


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


_BODIES = ("body", "orelse", "finalbody", "handlers", "cases")


def child_statements(node: ast.AST) -> Iterator[ast.AST]:
    """The statements (and except handlers, match cases) directly under `node`: an import is a statement, so it is
    found without visiting any expression (most of a syntax tree's nodes)."""
    for field in _BODIES:
        yield from getattr(node, field, None) or ()


def all_statements(tree: ast.AST) -> Iterator[ast.AST]:
    """Every statement under `tree`, nested ones included (`ast.walk` over statements only)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(child_statements(node))


def statements(
    node: ast.AST, lazy: bool = False, type_only: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Every import statement under `node`: (it, inside a function, inside `if TYPE_CHECKING:`)."""
    for child in child_statements(node):
        inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, inner, type_only
        elif _is_type_checking(child):
            for stmt in child.body:
                yield from statements(ast.Module(body=[stmt], type_ignores=[]), inner, True)
            for stmt in child.orelse:
                yield from statements(ast.Module(body=[stmt], type_ignores=[]), inner, type_only)
        else:
            yield from statements(child, inner, type_only)


def comments_of(lines: list[str], node: ast.stmt) -> str:
    """The comments on an import statement's lines (an import holds no string, so every `#` in it starts one)."""
    found = []
    for k in range(node.lineno, (node.end_lineno or node.lineno) + 1):
        text = lines[k - 1][node.col_offset :] if k == node.lineno else lines[k - 1]
        found += re.findall(r"#.*", text)
    return " ".join(found)


@functools.cache
def parsed(path: Path) -> tuple[str, ast.Module]:
    """A file's source and syntax tree (read once for every check)."""
    source = path.read_text()
    return source, ast.parse(source, str(path))


def read_imports(name: str, path: Path, known: dict[str, Path], source: str | None = None) -> list[Import]:
    """The imports of module `name` (file `path`, or `source`) of modules in `known`."""
    source, tree = parsed(path) if source is None else (source, ast.parse(source, str(path)))
    lines = source.splitlines()
    siblings = name.split(".")[0] != "embshard"
    out = []
    for node, lazy, type_only in statements(tree):
        note = comments_of(lines, node)
        for target in targets(node, name, path.name == "__init__.py", known, siblings):
            out.append(Import(name, target, path, node.lineno, lazy, type_only, note))
    return out


@functools.cache
def all_imports(top: str = "embshard") -> tuple[Import, ...]:
    known = modules(top)
    return tuple(i for name, path in known.items() for i in read_imports(name, path, known))


class Graph:
    """importer -> imported modules (with their packages), and where each edge comes from."""

    def __init__(self, imports: Iterable[Import], known: dict[str, Path]) -> None:
        self.edges: Edges = {name: set() for name in known}
        self.at: dict[tuple[str, str], list[Import]] = {}
        for i in imports:
            own = {".".join(i.source.split(".")[:k]) for k in range(1, i.source.count(".") + 2)}
            parts = i.target.split(".")
            for dep in (".".join(parts[:k]) for k in range(1, len(parts) + 1)):
                if dep in known and (dep not in own or dep == i.target != i.source):
                    self.edges[i.source].add(dep)
                    self.at.setdefault((i.source, dep), []).append(i)

    def collapse(self) -> Graph:
        """The package-level graph (`package_of`), without the imports marked `# upward: <why>` (each closes a
        cycle of its packages by design; the module-level graph keeps them)."""
        out = Graph((), {})
        for (a, b), found in self.at.items():
            found = [i for i in found if not UPWARD.search(i.note)]
            pa, pb = package_of(a), package_of(b)
            if not found:
                continue
            out.edges.setdefault(pa, set())
            if pa != pb:
                out.edges[pa].add(pb)
                out.at.setdefault((pa, pb), []).extend(found)
        return out

    def describe(self, comps: Iterable[list[str]]) -> str:
        """Each component with the edges inside it, each at the file:line of its imports."""
        lines = []
        for comp in comps:
            inside = set(comp)
            lines.append("cycle among " + ", ".join(comp) + ":")
            for a in comp:
                for b in sorted(self.edges.get(a, ()) & inside):
                    where = sorted({i.where() for i in self.at[(a, b)]})
                    lines.append(f"    {a} -> {b}    {', '.join(where)}")
        return "\n".join(lines)


def package_of(module: str) -> str:
    """The node a module counts as at package level: its sub-package (a package stands for itself), or the module
    itself if it sits in the top folder."""
    known = modules(module.split(".")[0])
    if known[module].name == "__init__.py" or module.count(".") == 1:
        return module
    return module.rpartition(".")[0]


def cycles(edges: Edges) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(edges):
        if v not in index:
            strong(v)
    return found


@functools.cache
def graph(top: str = "embshard") -> Graph:
    return Graph(all_imports(top), modules(top))


def layer_of(module: str) -> int | None:
    """The index in LAYERS of an embshard module's layer, None if it fits none."""
    if module in TOP:
        return LAYERS.index(TOP[module])
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS[:-1] else None


def upward_imports() -> list[Import]:
    """Imports of an embshard module from a higher layer than the importer's (with their packages)."""
    g = graph()
    out = []
    for (a, b), found in sorted(g.at.items()):
        la, lb = layer_of(a), layer_of(b)
        if la is not None and lb is not None and lb > la:
            out += found
    return out


def _listing(imports: Iterable[Import]) -> str:
    return "\n".join(
        sorted({f"    {i.source} -> {i.target}    {i.where()}" + (f"    {i.note}" if i.note else "") for i in imports})
    )


def test_graph_is_read():
    known = {"embshard": Path("__init__.py"), "embshard.a": Path("a.py"), "embshard.b": Path("b.py")}
    source = (
        "from typing import TYPE_CHECKING\nimport embshard.a\nif TYPE_CHECKING:\n    from embshard.b import X\n"
        "def f():\n    from . import b  # upward: the reason\n"
    )
    found = read_imports("embshard.c", Path("c.py"), known, source)
    assert [(i.target, i.lazy, i.type_only, bool(UPWARD.search(i.note))) for i in found] == [
        ("embshard.a", False, False, False),
        ("embshard.b", False, True, False),
        ("embshard.b", True, False, True),
    ]
    reads = read_imports("embshard.a", Path("a.py"), known, "from embshard import b, X\n")
    assert Graph(reads, known).edges["embshard.a"] == {"embshard", "embshard.b"}  # X: a name off the package root
    passes = read_imports("embshard.a", Path("a.py"), known, "import embshard.b\n")
    assert Graph(passes, known).edges["embshard.a"] == {"embshard.b"}  # through the root only
    source = "import y\nfrom y import z\nfrom bench.y import z\nfrom . import y\nimport torch, numpy\n"
    sibling = read_imports("bench.x", Path("x.py"), {"bench": Path("__init__.py"), "bench.y": Path("y.py")}, source)
    assert [i.target for i in sibling] == ["bench.y"] * 4  # torch, numpy: no sibling, no module of bench
    edges = graph().edges
    assert "embshard.spec.plan" in edges["embshard.collection.sharded"]
    assert "embshard.spec.tables" in edges["embshard.spec.plan"]
    assert "embshard.collection.sharded" in edges["embshard"]  # the public API's lazy door
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("embshard.spec.plan") == 0 and layer_of("embshard") == layer_of("embshard.cli") == len(LAYERS) - 1
    assert layer_of("embshard.elsewhere") is None


def test_no_import_cycle_between_modules():
    g = graph()
    found = cycles(g.edges)
    assert not found, "import cycles (module level, TYPE_CHECKING and lazy imports):\n" + g.describe(found)


def test_no_import_cycle_between_packages():
    g = graph().collapse()
    found = cycles(g.edges)
    assert not found, "import cycles between packages:\n" + g.describe(found)


def test_every_module_has_a_layer():
    lost = [m for m in modules() if layer_of(m) is None]
    assert not lost, f"modules in no layer of LAYERS {LAYERS}: {lost}; move each into a layer's package"


def test_imports_point_down_the_layers():
    """An import of a higher layer carries `# upward: <why>`; at most MAX_UPWARD such imports exist."""
    up = upward_imports()
    bare = [i for i in up if not UPWARD.search(i.note)]
    assert not bare, (
        f"imports from a lower layer to a higher one (layers, lowest first: {', '.join(LAYERS)}):\n{_listing(bare)}\n"
        "move what is imported down (or the importer up), or mark a needed one `# upward: <why>`"
    )
    marked = {(i.path, i.line) for i in up}
    assert len(marked) <= MAX_UPWARD, (
        f"{len(marked)} marked upward imports, at most {MAX_UPWARD} allowed:\n{_listing(up)}\n"
        "move what is imported down the layers"
    )
    stale = [i for i in all_imports() if UPWARD.search(i.note) and (i.path, i.line) not in marked]
    assert not stale, f"`upward:` notes on imports that do not go up a layer (remove the note):\n{_listing(stale)}"


def test_the_planner_library_imports_neither_the_app_nor_the_runtime():
    """embshard.planner plans on a laptop: it imports only embshard.spec and itself (not even lazily inside a
    function), and neither it nor spec imports the GPU stack (torch, triton, fbgemm_gpu, torchrec) at module level."""
    allowed = re.compile(r"^embshard(\.(spec|planner)(\..*)?)?$")
    above = [i for i in all_imports() if i.source.startswith("embshard.planner") and not allowed.match(i.target)]
    assert not above, f"the planner imports modules above embshard.spec / embshard.planner:\n{_listing(above)}"
    heavy = []
    for name, path in modules().items():
        if layer_of(name) is not None and LAYERS[layer_of(name)] in TORCH_FREE:
            for node, lazy, type_only in statements(parsed(path)[1]):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if (
                    not lazy
                    and not type_only
                    and not getattr(node, "level", 0)
                    and {n.split(".")[0] for n in names} & TORCH_STACK
                ):
                    heavy.append(f"    {path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not heavy, f"{'/'.join(TORCH_FREE)} import the GPU stack at module level:\n" + "\n".join(heavy)


def test_no_import_cycle_in_bench():
    g = graph("bench")
    found = cycles(g.edges)
    assert not found, "import cycles among bench/'s modules:\n" + g.describe(found)


# Import name -> distribution name, where they differ. fbgemm_gpu is fbgemm-gpu on GPU machines and fbgemm-gpu-cpu in
# the CPU pins (requirements/cpu.txt).
DISTRIBUTION = {
    "yaml": "pyyaml",
    "fbgemm_gpu": "fbgemm-gpu",
    "PIL": "pillow",
    "google": "protobuf",
    "xdist": "pytest-xdist",
}
CPU_DISTRIBUTION = {"fbgemm-gpu": "fbgemm-gpu-cpu"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def third_party_imports(folder: Path) -> dict[str, set[str]]:
    """Distribution name -> files under `folder` importing it (module level or inside functions): every import
    whose top-level name is neither the standard library, embshard, nor a module of the repository (tests' and
    bench's own helpers)."""
    own = {"embshard", "bench"} | {
        p.stem for d in ("tests", "bench", "launch", "examples") for p in (ROOT / d).rglob("*.py")
    }
    out: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        for node in all_statements(parsed(path)[1]):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in own:
                    out.setdefault(_norm(DISTRIBUTION.get(top, top)), set()).add(str(path.relative_to(ROOT)))
    return out


def _requirement_name(spec: str) -> str:
    return _norm(re.split(r"[\s<>=!~;\[]", spec.strip(), maxsplit=1)[0])


def declared() -> tuple[set[str], set[str]]:
    """(pyproject's dependencies + the gpu extra, the packages pinned in requirements/*.txt)."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    gpu = {_requirement_name(s) for s in project["dependencies"] + project["optional-dependencies"]["gpu"]}
    pinned = set()
    for path in (ROOT / "requirements").glob("*.txt"):
        for line in path.read_text().splitlines():
            if line.split("#")[0].strip():
                pinned.add(_requirement_name(line.split("#")[0]))
    return gpu, pinned


def test_every_third_party_import_is_declared():
    gpu, pinned = declared()
    package = third_party_imports(ROOT / "embshard")
    assert {"torch", "fbgemm-gpu", "torchrec", "pyarrow", "pyyaml", "numpy"} <= set(package), sorted(package)
    missing = {d: sorted(f)[:3] for d, f in package.items() if d not in gpu}
    assert not missing, (
        f"embshard imports packages that pyproject.toml declares neither in dependencies nor in the gpu extra "
        f"(so `pip install -e .[gpu]` lacks them): {missing}; add each to the gpu extra with a version range"
    )
    unpinned = {d: sorted(f)[:3] for d, f in package.items() if CPU_DISTRIBUTION.get(d, d) not in pinned}
    assert not unpinned, f"embshard imports packages that requirements/*.txt do not pin (make install): {unpinned}"
    suite = {d: sorted(f)[:3] for d, f in third_party_imports(ROOT / "tests").items() if d not in gpu}
    assert not suite, f"tests/ imports packages missing from pyproject's gpu extra (the GPU test suite): {suite}"
    assert _requirement_name("fbgemm-gpu>=1.6,<1.9") == "fbgemm-gpu" and _norm("PyYAML") == "pyyaml"


if __name__ == "__main__":
    for label, g in (("modules", graph()), ("packages", graph().collapse()), ("bench", graph("bench"))):
        print(f"{label}: " + (g.describe(cycles(g.edges)) or "no cycle"))
    print("upward imports:\n" + (_listing(upward_imports()) or "    none"))
    print("modules in no layer: " + (", ".join(m for m in modules() if layer_of(m) is None) or "none"))
