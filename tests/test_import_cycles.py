"""No import cycles, of any length, among the modules of ``ttt_lm/`` and ``kernels/``; and
``kernels/`` never imports ``ttt_lm``.

The graph is read from the source with ``ast``: every ``import`` statement counts, at module level
or inside a function (an import hidden in a function is still a dependency, and the usual way to
hide a cycle). An edge A → M means that importing A may need M to be initialised:

* ``import a.b.c`` and ``from a.b.c import x`` depend on ``a.b.c``; ``from a.b import c``, where
  ``c`` is a module, depends on ``a.b.c``; ``from a.b import x``, where ``x`` is a name bound by
  ``a/b/__init__.py``, depends on ``a.b``. Relative imports are resolved first. So a submodule
  that takes a *name* from its own package while the package's ``__init__`` imports that
  submodule is a cycle: the name exists only once the ``__init__`` has reached it (the
  ``kernels/linear_scan/resets.py`` that was, importing ``linear_scan`` from the package, had to be
  imported at the bottom of the package's ``__init__``).
* Python also runs the packages above an imported module first; those implicit steps are not
  edges. Counting them would make each user of a light submodule depend on every lazy import in
  its package's ``__init__`` functions (``ttt_lm.config`` uses ``ttt_lm.train.config``, and
  ``ttt_lm/train/__init__.py``'s ``main`` imports the trainer when called).

Cycles are the strongly connected components of more than one module (Tarjan's algorithm).

A second graph holds what runs when a module is imported, and only that: its module-level
imports (not those inside functions), each with the packages above the imported module that are
not above the importer (Python runs their ``__init__`` first). A cycle there fails at import
time, depending on which module is imported first: ``kernels/kda/shapes.py`` once took a check
from ``kernels.gated_delta_rule.shapes``, which ran ``kernels/gated_delta_rule/__init__.py``, whose
reference imported ``kernels.kda.reference`` while it was half-initialised (``import kernels.kda``
failed; importing ``kernels.gated_delta_rule`` first worked).
"""
from __future__ import annotations

import ast
import os
from typing import Dict, Iterable, List, Set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("ttt_lm", "kernels")


def modules(root: str = ROOT, packages: Iterable[str] = PACKAGES) -> Dict[str, str]:
    """Dotted module name → file, for every .py file under ``root/<package>`` (a package is named
    by its ``__init__.py``)."""
    out = {}
    for top in packages:
        for d, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), root)[:-3].replace(os.sep, ".")
                    out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(d, f)
    return out


def _module_level(tree):
    """The nodes that run when the module is imported: everything but the bodies of functions
    (class bodies and module-level if/try blocks run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(c for c in ast.iter_child_nodes(node)
                    if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))


def imported_names(path: str, this: str, eager: bool = False) -> List[tuple]:
    """Every import in the file, anywhere in it (``eager``: at module level only), as (absolute
    module, names taken from it or None for a plain ``import``); relative imports resolved
    against ``this`` (the file's module)."""
    pkg = this if os.path.basename(path) == "__init__.py" else this.rpartition(".")[0]
    out = []
    tree = ast.parse(open(path).read(), path)
    for node in (_module_level(tree) if eager else ast.walk(tree)):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                if node.level - 1 > len(parts) - 1:
                    raise ValueError(f"{path}:{node.lineno}: relative import beyond the top-level package")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            out.append((base, [a.name for a in node.names]))
    return out


def imports(path: str, mods: Dict[str, str], this: str, eager: bool = False) -> Set[str]:
    """The modules of ``mods`` that the file ``path`` (module ``this``) depends on (``eager``:
    what importing it runs: module-level imports and the packages above them)."""
    got: Set[str] = set()
    for base, names in imported_names(path, this, eager):
        if names is None:
            # `import a.b.c`: the deepest of a.b.c, a.b, a that is one of ours
            parts = base.split(".")
            got |= {next((m for m in (".".join(parts[:i]) for i in range(len(parts), 0, -1)) if m in mods), None)}
            continue
        for n in names:
            if f"{base}.{n}" in mods:
                got.add(f"{base}.{n}")            # a submodule
            elif base in mods:
                got.add(base)                     # a name bound by `base` (its own package included)
    got.discard(None)
    if eager:   # the packages above each imported module, but for those above this one
        mine = {".".join(this.split(".")[:i]) for i in range(1, this.count(".") + 2)}
        got |= {a for m in list(got) for a in (".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1))
                if a in mods and a not in mine}
    got.discard(this)
    return got


def graph(root: str = ROOT, packages: Iterable[str] = PACKAGES, eager: bool = False) -> Dict[str, Set[str]]:
    mods = modules(root, packages)
    return {m: imports(p, mods, m, eager) for m, p in mods.items()}


def strongly_connected(g: Dict[str, Set[str]]) -> List[List[str]]:
    """Tarjan's strongly connected components of ``g`` (iterative), each sorted, in sorted order."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []
    for start in sorted(g):
        if start in index:
            continue
        work = [(start, iter(sorted(g.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return sorted(out)


def cycles(g: Dict[str, Set[str]]) -> List[List[str]]:
    """One import cycle (a → b → … → a) through each strongly connected component of more than
    one module: the shortest one from and back to the component's first module."""
    found = []
    for comp in strongly_connected(g):
        if len(comp) < 2:
            continue
        inside, start = set(comp), comp[0]
        prev: Dict[str, str] = {}
        frontier, last = [start], None
        while last is None:          # in a strongly connected component the way back exists
            nxt = []
            for v in frontier:
                for w in sorted(g[v] & inside):
                    if w == start and last is None:
                        last = v
                    elif w != start and w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [last]
        while path[-1] != start:
            path.append(prev[path[-1]])
        found.append(path[::-1] + [start])
    return found


def test_no_import_cycles_in_ttt_lm_and_kernels():
    g = graph()
    assert any(m.startswith("kernels.") for m in g) and any(m.startswith("ttt_lm.") for m in g)
    found = cycles(g)
    assert found == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_import_time_cycles_through_packages():
    g = graph(eager=True)
    assert "kernels.gated_delta_rule" in g["kernels.kda.reference"] or \
        "kernels.delta_rule" in g["kernels.kda.shapes"]      # the package edges are there
    found = cycles(g)
    assert found == [], "import-time cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_import_time_graph_sees_a_cycle_through_a_package_init(tmp_path):
    """The shape kda had: a.shapes takes a check from b.shapes, which runs b/__init__, whose
    reference imports a.reference while a is half-initialised. Lazy imports inside functions are
    not part of this graph, and a module's own packages are not edges."""
    _write(tmp_path, {
        "top/__init__.py": "",
        "top/a/__init__.py": "from top.a.reference import ref\n",
        "top/a/reference.py": "from top.a.shapes import check\n\ndef ref():\n    pass\n",
        "top/a/shapes.py": "from top.b.shapes import check\n",
        "top/b/__init__.py": "from top.b.reference import ref_b\n",
        "top/b/reference.py": "from top.a.reference import ref\n\ndef ref_b():\n    pass\n",
        "top/b/shapes.py": "def check():\n    pass\n",
        "top/c/__init__.py": "def main():\n    from top.c.run import go\n",
        "top/c/run.py": "from top.d import x\n\ndef go():\n    pass\n",
        "top/d.py": "from top.c.conf import y\n\nx = 1\n",
        "top/c/conf.py": "y = 1\n",
    })
    lazy_free = graph(str(tmp_path), ("top",), eager=True)
    assert lazy_free["top.a.shapes"] == {"top.b.shapes", "top.b"}
    assert lazy_free["top.c"] == set() and lazy_free["top.d"] == {"top.c.conf", "top.c"}
    comps = [c for c in strongly_connected(lazy_free) if len(c) > 1]
    assert comps == [["top.a", "top.a.reference", "top.a.shapes", "top.b", "top.b.reference"]], comps
    # without the package edge (b.shapes moved under a), no cycle
    (tmp_path / "top/a/shapes.py").write_text("def check():\n    pass\n")
    assert [c for c in strongly_connected(graph(str(tmp_path), ("top",), eager=True)) if len(c) > 1] == []


def test_kernels_never_import_ttt_lm():
    mods = modules(packages=("kernels",))
    bad = sorted((m, base) for m, p in mods.items() for base, _ in imported_names(p, m)
                 if base == "ttt_lm" or base.startswith("ttt_lm."))
    assert len(mods) > 10 and bad == [], bad


def _write(root, files: Dict[str, str]):
    for rel, src in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(src)


def test_the_finder_sees_a_three_module_cycle_and_a_package_taking_back_its_submodule(tmp_path):
    """a → b → c → a (through a function-level and a relative import); pkg/__init__ imports
    pkg.sub, which takes a name back from pkg (the shape kernels/linear_scan had); none of the
    harmless shapes beside them is a cycle."""
    _write(tmp_path, {
        "top/__init__.py": "",
        "top/a.py": "import top.b\n",
        "top/b.py": "def f():\n    from top.c import g\n",
        "top/c.py": "from . import a\n\ndef g():\n    pass\n",
        "top/d.py": "from top import a\n",                      # into the cycle, not part of it
        "top/pkg/__init__.py": "def op():\n    pass\n\nfrom top.pkg.sub import op2\n",
        "top/pkg/sub.py": "def op2():\n    from top.pkg import op\n",
        # a package re-exporting its submodules, which import their siblings and the package's
        # submodules by name: not a cycle
        "top/ok/__init__.py": "from top.ok.x import fx\nfrom .y import fy\n",
        "top/ok/x.py": "from top.ok import y\n\ndef fx():\n    pass\n",
        "top/ok/y.py": "import top.ok.z\n\ndef fy():\n    pass\n",
        "top/ok/z.py": "",
    })
    g = graph(str(tmp_path), ("top",))
    assert g["top.c"] == {"top.a"} and g["top.d"] == {"top.a"} and g["top.pkg.sub"] == {"top.pkg"}
    assert g["top.ok.x"] == {"top.ok.y"} and g["top.ok"] == {"top.ok.x", "top.ok.y"}
    assert strongly_connected(g) == [["top"], ["top.a", "top.b", "top.c"], ["top.d"], ["top.ok"],
                                     ["top.ok.x"], ["top.ok.y"], ["top.ok.z"], ["top.pkg", "top.pkg.sub"]]
    assert cycles(g) == [["top.a", "top.b", "top.c", "top.a"], ["top.pkg", "top.pkg.sub", "top.pkg"]]
    # breaking one edge breaks the 3-cycle
    (tmp_path / "top/c.py").write_text("def g():\n    pass\n")
    assert cycles(graph(str(tmp_path), ("top",))) == [["top.pkg", "top.pkg.sub", "top.pkg"]]


def test_the_graph_sees_imports_inside_functions(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\n\ndef f():\n    from ttt_lm.train import reshard\n    import ttt_lm.data.errors\n")
    got = imports(str(src), modules(), "ttt_lm.train.m")
    assert got == {"ttt_lm.train.reshard", "ttt_lm.data.errors"}, got
    assert "ttt_lm.data.errors" in graph()["ttt_lm.data.remote"]
