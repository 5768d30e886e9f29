"""The rules python/l2prefetch/DESIGN.md states, read off the code (issue 39): no module
uses another's private name, no needless lazy import, no function over 120 lines, import
is free of torch, files go through _files.py, profile.py alone knows the profile's fields,
and the Backend's defaults are the ones DESIGN.md lists.  Pure Python: ast and imports."""

import ast
import os
import re
import subprocess
import sys
import textwrap

import pytest

import l2prefetch

PACKAGE = os.path.dirname(os.path.abspath(l2prefetch.__file__))
DESIGN = os.path.join(PACKAGE, "DESIGN.md")
#: The modules of the package whose names start with "_": importing one is fine.
PRIVATE_MODULES = {"_C", "_files", "_parser", "_torch", "_version"}
#: The longest a function may be (issue 39, "Done when").
MAX_FUNCTION_LINES = 120
MAX_CLASS_LINES = 300


def files():
    """(dotted name relative to the package, path, tree) of every module of the package."""
    out = []
    for root, _, names in os.walk(PACKAGE):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                dotted = os.path.relpath(path, PACKAGE)[:-3].replace(os.sep, ".")
                with open(path, encoding="utf-8") as f:
                    out.append((dotted, path, ast.parse(f.read(), path)))
    return sorted(out)


def source_of(module, node):
    """The dotted module (relative to the package) that ``from ... import`` names in module."""
    package = module.split(".")[:-1]
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def is_module(dotted):
    """A module of the package (a package's own name, its __init__, is not one here)."""
    path = os.path.join(PACKAGE, *dotted.split("."))
    return dotted == "_C" or os.path.exists(path + ".py")


def private(name):
    return name.startswith("_") and not name.startswith("__")


def top_level_imports(module, tree):
    """The package modules a module imports at its top (by from-import), and the names it
    binds to package modules there or anywhere."""
    loaded, bound = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            source = source_of(module, node)
            for alias in node.names:
                target = f"{source}.{alias.name}" if source else alias.name
                if is_module(target):
                    bound[alias.asname or alias.name] = target
                    if node in tree.body:
                        loaded.add(target)
                elif node in tree.body and is_module(source):
                    loaded.add(source)
    return loaded, bound


# ---------------------------------------------------------------------- private names

def private_uses(module, tree):
    """Where module uses another module's private name: ``from .plan import _layer_of``,
    ``hf._one_line``.  The package's private modules (``from . import _files``) and their
    public names are no such use.  The C extension's underscored functions
    (``_C._graph_edges``, ``_C._use_driver``) are its entry points for the tuner's rig
    and the tests, not for users: exempt."""
    found = []
    _, bound = top_level_imports(module, tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            source = source_of(module, node)
            for alias in node.names:
                if private(alias.name) and alias.name not in PRIVATE_MODULES:
                    found.append(f"{module}:{node.lineno}: from {source or '.'} import "
                                 f"{alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("l2prefetch"):
            found += [f"{module}:{node.lineno}: from {node.module} import {a.name}"
                      for a in node.names if private(a.name) and a.name not in PRIVATE_MODULES]
        elif (isinstance(node, ast.Attribute) and private(node.attr)
              and isinstance(node.value, ast.Name) and node.value.id in bound
              and bound[node.value.id] != "_C"):
            found.append(f"{module}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_name():
    found = [use for module, _, tree in files() for use in private_uses(module, tree)]
    assert found == [], "private names used across modules:\n" + "\n".join(found)


def test_the_private_name_check_finds_both_kinds():
    tree = ast.parse("from .. import _C, _files\nfrom . import hf\n"
                     "from ..plan import _layer_of, PlanEntry\n"
                     "from .._files import read_text\n"
                     "def f():\n    return hf._one_line(_C._graph_edges(_files.read_text()))\n")
    assert [use.split(": ", 1)[1] for use in private_uses("tuning.cli", tree)] == [
        "from plan import _layer_of", "hf._one_line"]


# ---------------------------------------------------------------------- lazy imports

#: (module, the module it imports again lazily), left for now: none.
LAZY_KNOWN: set = set()


def needless_lazy_imports(module, tree):
    """The imports inside functions of a module that module imports at its top."""
    found = []
    loaded, _ = top_level_imports(module, tree)
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.ImportFrom) and node.level:
                source = source_of(module, node)
                targets = {f"{source}.{a.name}" if source else a.name for a in node.names}
                again = (targets | {source}) & loaded - {
                    target for known, target in LAZY_KNOWN if known == module}
                if again:
                    found.append(f"{module}:{node.lineno} in {function.name}: {sorted(again)}")
    return found


def test_no_lazy_import_of_a_module_imported_at_the_top():
    """A lazy import has a reason (torch not imported at ``import l2prefetch``, the trace
    modules loaded only when the command runs, a cycle); a module imported at the top of
    the same file has none."""
    found = [lazy for module, _, tree in files() for lazy in needless_lazy_imports(module, tree)]
    assert found == [], "lazy imports of modules imported at the top:\n" + "\n".join(found)


def test_the_lazy_import_check_finds_one():
    tree = ast.parse("from .hf import MAX_SEED\nfrom .. import _C\n"
                     "def run():\n    from . import hf, trace\n    from .. import _C\n"
                     "    from .. import PreparedWeightRanges\n")
    assert [lazy.split(": ", 1)[1] for lazy in needless_lazy_imports("tuning.cli", tree)] == [
        "['tuning.hf']", "['_C']"]


# ---------------------------------------------------------------------- function length

#: Over the limit, left for now: none.
LONG_KNOWN: set = set()


def test_no_function_is_over_120_lines():
    found = []
    for module, _, tree in files():
        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{child.name}"
                    lines = child.end_lineno - child.lineno + 1
                    if (not isinstance(child, ast.ClassDef) and lines > MAX_FUNCTION_LINES
                            and f"{module}:{name}" not in LONG_KNOWN):
                        found.append(f"{module}:{name} ({lines} lines)")
                    visit(child, name + ".")
                else:
                    visit(child, prefix)
        visit(tree, "")
    assert found == [], f"functions over {MAX_FUNCTION_LINES} lines: {found}"


def test_no_class_is_over_300_lines():
    """Issue 39: the search's _Batch (505 lines) and GraphBackend (579) did every job of
    theirs in one class; a class this long is cut along its jobs."""
    found = [f"{module}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
             for module, _, tree in files() for node in ast.walk(tree)
             if isinstance(node, ast.ClassDef)
             and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert found == [], f"classes over {MAX_CLASS_LINES} lines: {found}"


# ---------------------------------------------------------------------- import is free

def test_import_is_free_of_torch():
    """DESIGN.md: every module but ops.py and tuning/synthetic.py imports without torch
    (torch is imported inside the functions that use it), and those two say how to get
    it (_torch.require)."""
    code = textwrap.dedent("""
        import importlib, pkgutil, sys
        sys.modules["torch"] = None
        import l2prefetch
        for info in pkgutil.walk_packages(l2prefetch.__path__, "l2prefetch."):
            try:
                importlib.import_module(info.name)
            except ImportError as exc:
                print(info.name, "|", exc)
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stderr
    refused = dict(line.split(" | ") for line in out.stdout.splitlines())
    assert sorted(refused) == ["l2prefetch.ops", "l2prefetch.tuning.synthetic"], out.stdout
    for name, message in refused.items():
        assert message == f"{name} needs torch, which is not installed: install torch " \
                          "2.11-2.13 (README, Install)"


def test_the_modules_design_md_calls_plain_import_neither_torch_nor_c():
    """DESIGN.md: mechanisms.py, model_paths.py and _files.py import neither torch nor the C
    extension (plan.py imports no torch; it uses _C, which import l2prefetch loads)."""
    plain = {"mechanisms": {"torch", "_C"}, "model_paths": {"torch", "_C"},
             "_files": {"torch", "_C"}, "plan": {"torch"}}
    for module, _, tree in files():
        if module not in plain:
            continue
        named = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                named |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                named.add((node.module or "").split(".")[0])
                named |= {a.name for a in node.names}
        # a TYPE_CHECKING import of torch is for annotations only
        checking = [n for n in ast.walk(tree) if isinstance(n, ast.If)
                    and getattr(n.test, "id", None) == "TYPE_CHECKING"]
        for block in checking:
            for node in ast.walk(block):
                if isinstance(node, ast.Import):
                    named -= {a.name for a in node.names}
        assert not named & plain[module], f"{module} imports {sorted(named & plain[module])}"


# ---------------------------------------------------------------------- files

#: Calls that open or write a file by path.
OPENERS = {"open", "fdopen"}
PATH_METHODS = {"read_text", "write_text", "read_bytes", "write_bytes", "open"}
#: What torch or the driver write by path: only into a private temporary directory, read
#: back through _files (trace_capture.py).
FOREIGN_WRITERS = {"debug_dump", "export_chrome_trace"}


def file_opens(module, tree):
    """Where module opens or writes a file by path itself, or lets torch or the driver
    write one outside a private temporary directory."""
    found, private_dirs = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and any(
                isinstance(i.context_expr, ast.Call)
                and getattr(i.context_expr.func, "attr", None) == "TemporaryDirectory"
                for i in node.items):
            private_dirs |= {id(n) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        receiver = getattr(getattr(func, "value", None), "id", None)
        if isinstance(func, ast.Name) and name in OPENERS:
            found.append(f"{module}:{node.lineno}: {name}()")
        elif isinstance(func, ast.Attribute) and receiver in ("os", "io") and name in OPENERS:
            found.append(f"{module}:{node.lineno}: {receiver}.{name}()")
        elif isinstance(func, ast.Attribute) and name in PATH_METHODS \
                and receiver not in ("_files", "os", "io", "tempfile"):
            found.append(f"{module}:{node.lineno}: .{name}()")
        elif name in FOREIGN_WRITERS and id(node) not in private_dirs:
            found.append(f"{module}:{node.lineno}: {name}() outside a TemporaryDirectory")
        elif name in ("load", "dump") and receiver == "json":
            found.append(f"{module}:{node.lineno}: json.{name}()")
    return found


def test_files_are_opened_through_files_py():
    """DESIGN.md: every file the Python side opens is opened through _files.py; what torch
    and the driver write goes into a private temporary directory."""
    found = [use for module, _, tree in files() if module != "_files"
             for use in file_opens(module, tree)]
    assert found == [], "files opened without _files.py:\n" + "\n".join(found)


def test_the_file_check_finds_each_kind():
    tree = ast.parse("import json, os, tempfile\n"
                     "def f(path, graph, prof):\n"
                     "    open(path).read()\n    os.fdopen(3)\n    path.write_text('x')\n"
                     "    json.dump({}, path)\n    graph.debug_dump(path)\n"
                     "    with tempfile.TemporaryDirectory() as tmp:\n"
                     "        prof.export_chrome_trace(tmp)\n")
    assert sorted(use.split(": ", 1)[1] for use in file_opens("m", tree)) == [
        ".write_text()", "debug_dump() outside a TemporaryDirectory", "json.dump()", "open()",
        "os.fdopen()"]


# ---------------------------------------------------------------------- the profile

#: The modules that hand the profile data or read one through profile.py.
PROFILE_CLIENTS = {"tuning.tuner", "tuning.cli", "tuning.trace_cli", "tuning.trace_capture",
                   "tuning.report"}


def profile_fields_named(module, tree, fields):
    """Where module builds an object holding two of the profile's ``fields`` or, in a
    :data:`PROFILE_CLIENTS` module, names one as a key (a subscript, ``.get``, a dict's)."""
    found = []
    for node in ast.walk(tree):
        keys = []
        if isinstance(node, ast.Dict):
            named = [k.value for k in node.keys if isinstance(k, ast.Constant)
                     and k.value in fields]
            if len(named) >= 2:
                found.append(f"{module}:{node.lineno}: an object of {named}")
            keys = node.keys
        elif isinstance(node, ast.Subscript):
            keys = [node.slice]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in (
                "get", "setdefault", "pop") and node.args:
            keys = [node.args[0]]
        if module in PROFILE_CLIENTS:
            found += [f"{module}:{k.lineno}: {k.value!r}" for k in keys
                      if isinstance(k, ast.Constant) and k.value in fields]
    return found


def profile_fields():
    from l2prefetch import profile

    return set(profile.ENTRY_KEYS) | set(profile.DOCUMENT_KEYS) | set(profile.STEP_KEYS)


def test_the_tuner_names_no_field_of_the_profile():
    """DESIGN.md: profile.py alone knows the profile's fields.  The modules that hand it
    data or read a profile through it (tune, its command, the trace) name none of them as
    a key; and no module but profile.py (and plan.py, whose plan JSON shares an entry's
    names) builds an object holding two of them."""
    fields = profile_fields()
    found = [use for module, _, tree in files() if module not in ("profile", "plan")
             for use in profile_fields_named(module, tree, fields)]
    assert found == [], "the profile's fields outside profile.py:\n" + "\n".join(found)


def test_the_profile_field_check_finds_both_kinds():
    tree = ast.parse("entry = {'point': p, 'site': s}\nbatches = data['batches']\n"
                     "hook = raw.get('hook')\nsettings = {'rounds': 1}\n")
    fields = profile_fields()
    assert profile_fields_named("tuning.arms", tree, fields) == [
        "tuning.arms:1: an object of ['point', 'site']"]
    assert sorted(profile_fields_named("tuning.tuner", tree, fields)) == [
        "tuning.tuner:1: 'point'", "tuning.tuner:1: 'site'",
        "tuning.tuner:1: an object of ['point', 'site']", "tuning.tuner:2: 'batches'",
        "tuning.tuner:3: 'hook'"]


# ---------------------------------------------------------------------- the Backend

def test_design_md_lists_the_backends_own_members_and_its_defaults():
    pytest.importorskip("torch")
    from l2prefetch.tuning.arms import Backend

    text = " ".join(open(DESIGN, encoding="utf-8").read().split())
    own = re.search(r"((?:`\w+`,? (?:and )?)+)are each backend's own", text)
    defaults = re.search(r"((?:`\w+`,? (?:and )?)+)have documented defaults", text)
    assert own and defaults, "DESIGN.md no longer says which members are whose"
    listed_own = set(re.findall(r"`(\w+)`", own.group(1)))
    listed_defaults = set(re.findall(r"`(\w+)`", defaults.group(1)))
    members = {name for name in vars(Backend) if not name.startswith("_")}
    abstract = set(Backend.__abstractmethods__) | {
        name for name in Backend.__annotations__ if name not in vars(Backend)}
    assert listed_own == abstract
    assert listed_defaults == members - abstract
