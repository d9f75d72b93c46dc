"""The kernels are leaves (DESIGN.md section 8): pallas_kernels/ imports nothing from the library core, and no module
of the kernels or of the core's cache layers hides an import inside a function (where a cycle would hide too).
ulacache_jax/pallas_kernels and ulacache_jax/models are links to the top-level folders, which is how tools and a
bare checkout resolve those imports."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = sorted(f for f in os.listdir(os.path.join(ROOT, "pallas_kernels")) if f.endswith(".py"))
NO_LOCAL_IMPORTS = [os.path.join("pallas_kernels", f) for f in KERNELS] + [
    os.path.join("ulacache_jax", "cache", f) for f in ("lid.py", "pb_lru.py", "vtlb.py", "select/quest.py")]


def _imports(path):
    tree = ast.parse(open(os.path.join(ROOT, path)).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield node, [a.name for a in node.names], 0
        elif isinstance(node, ast.ImportFrom):
            yield node, [node.module or ""], node.level


@pytest.mark.parametrize("name", KERNELS)
def test_kernels_import_no_core(name):
    for node, mods, level in _imports(os.path.join("pallas_kernels", name)):
        for m in mods:
            assert level <= 1, f"{name}:{node.lineno} imports from outside pallas_kernels (level {level})"
            assert level == 1 or not m.split(".")[0] in ("ulacache_jax", "models", "pallas_kernels"), \
                f"{name}:{node.lineno} imports {m}: kernels take arrays and static configs, not core modules"


@pytest.mark.parametrize("path", NO_LOCAL_IMPORTS)
def test_no_function_local_imports(path):
    tree = ast.parse(open(os.path.join(ROOT, path)).read(), path)
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                assert not isinstance(node, (ast.Import, ast.ImportFrom)), \
                    f"{path}:{node.lineno}: import inside {fn.name}()"


@pytest.mark.parametrize("name", ["pallas_kernels", "models"])
def test_subpackage_links(name):
    link = os.path.join(ROOT, "ulacache_jax", name)
    assert os.path.islink(link) and os.readlink(link) == os.path.join("..", name)
    import ulacache_jax
    mod = __import__(f"ulacache_jax.{name}", fromlist=["_"])
    assert os.path.realpath(mod.__file__) == os.path.join(os.path.realpath(ROOT), name, "__init__.py")
    assert ulacache_jax.__path__ == [os.path.dirname(ulacache_jax.__file__)]  # no path patching
