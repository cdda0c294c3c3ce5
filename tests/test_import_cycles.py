"""No two modules of the package import each other, at module level or inside a function (an
import hidden in a function is still a dependency). Read from the source with ``ast``; a
``from package import name`` counts as importing ``package.name`` when that is a module."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "ttt_lm")


def _modules():
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(d, f)
    return out


def _imports(path, mods, this):
    pkg = this if path.endswith("__init__.py") else this.rsplit(".", 1)[0]
    got = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for n in names:
            if n in mods and n != this:
                got.add(n)
    return got


def graph():
    mods = _modules()
    return {m: _imports(p, mods, m) for m, p in mods.items()}


def test_no_two_modules_import_each_other():
    g = graph()
    # a package's __init__ re-exporting its submodules is not a circle with them
    pairs = sorted({tuple(sorted((a, b))) for a, deps in g.items() for b in deps
                    if a in g.get(b, ()) and not (a.startswith(b + ".") or b.startswith(a + "."))})
    assert pairs == [], pairs


def test_the_graph_sees_imports_inside_functions(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\n\ndef f():\n    from ttt_lm.train import reshard\n    import ttt_lm.data.errors\n")
    got = _imports(str(src), _modules(), "ttt_lm.train.m")
    assert got == {"ttt_lm.train", "ttt_lm.train.reshard", "ttt_lm.data.errors"}, got
    assert "ttt_lm.data.errors" in graph()["ttt_lm.data.remote"]
