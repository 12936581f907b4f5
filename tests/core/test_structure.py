"""Static architecture rules, checked on the AST alone (no project, jax or torch imports).

Every rule is a small helper returning a list of violations; the tests run it on the real
tree, and the self-checks at the bottom run it on tiny in-memory trees to prove it can fail.
"""

import ast
import fnmatch
import pathlib
import re
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("jaxpar", "torchpar", "parity_tests", "tests")
FRAMEWORKS = {"jax", "jaxlib", "flax", "optax", "orbax", "grain", "torch", "deepspeed"}
TRAINERS = ("jaxpar/train.py", "torchpar/train.py")
TWINS = ("jaxpar/models", "torchpar/models")  # the same files, each with the same role and names
# Smell detectors on formatted code (ruff format spreads a long call over lines): a file or a function past them is
# worth a look, and a concept is not split to meet them
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_TRAINER_LINES = 600, 100, 150


def load_files(root=ROOT):
    """{relative posix path: source} for every .py file under the four directories."""
    return {
        p.relative_to(root).as_posix(): p.read_text(encoding="utf-8")
        for d in PACKAGES
        for p in sorted((root / d).rglob("*.py"))
    }


def module_of(path):
    """'a/b/c.py' -> ('a.b.c', False); 'a/b/__init__.py' -> ('a.b', True)."""
    parts = path[: -len(".py")].split("/")
    is_pkg = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_pkg else parts), is_pkg


def under(name, prefix):
    return name == prefix or name.startswith(prefix + ".")


def imports_of(source, module, is_pkg, known):
    """Imported module names, anywhere in the file (ast.walk also sees imports inside functions).

    Project targets are resolved to the named module only; the parent packages' __init__s that
    Python also runs are left out on purpose, else every empty __init__ would close a cycle.
    """

    def longest_known(name):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in known:
                return ".".join(parts[:i])
        return name  # third-party / stdlib (or a missing project module): keep it as written

    package = module if is_pkg else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(longest_known(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: climb level-1 packages up from our own package
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                found.add(full if full in known else longest_known(base) if base else full)
    found.discard(module)  # `from pkg import x` inside pkg/__init__ is not a cycle
    return found


def build_graph(files):
    """{module: set of imported names}; edges to project modules use their module names."""
    mods = {path: module_of(path) for path in files}
    known = {name for name, _ in mods.values()}
    return {name: imports_of(files[path], name, is_pkg, known) for path, (name, is_pkg) in mods.items()}


def find_cycles(graph):
    """Strongly connected components (Tarjan) of size > 1, plus self-loops, among project modules."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v] & graph.keys():
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1 or v in graph[v]:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def imports_matching(graph, importer_prefix, bad):
    """Sorted (importer, imported) pairs where an importer under the prefix imports a `bad` name."""
    return sorted((mod, dep) for mod, deps in graph.items() if under(mod, importer_prefix) for dep in deps if bad(dep))


def core_violations(graph):
    # Shared core: no framework at all, and nothing from the project outside itself.
    return imports_matching(
        graph,
        "jaxpar.core",
        lambda dep: (
            dep.split(".")[0] in FRAMEWORKS or (dep.split(".")[0] in PACKAGES and not under(dep, "jaxpar.core"))
        ),
    )


def torchpar_violations(graph):
    return imports_matching(graph, "torchpar", lambda dep: under(dep, "jaxpar") and not under(dep, "jaxpar.core"))


def tools_violations(graph):
    """(importer, tools module) for every import of a tools folder from outside one: the library never reads them."""
    is_tools = lambda m: under(m, "jaxpar.tools") or under(m, "torchpar.tools")
    return sorted(
        (mod, dep)
        for mod, deps in graph.items()
        if mod.split(".")[0] in ("jaxpar", "torchpar") and not is_tools(mod)
        for dep in deps
        if is_tools(dep)
    )


def shared_base_names(files, package="jaxpar"):
    """{base name: its paths} for every file name that two files inside `package` share (__init__/__main__ aside)."""
    paths = {}
    for path in files:
        name = path.rpartition("/")[2]
        if path.startswith(package + "/") and name not in ("__init__.py", "__main__.py"):
            paths.setdefault(name, []).append(path)
    return {name: sorted(ps) for name, ps in paths.items() if len(ps) > 1}


def imports_of_test_code(graph):
    is_test = lambda dep: dep.split(".")[0] in {"tests", "parity_tests", "pytest"}
    return imports_matching(graph, "jaxpar", is_test) + imports_matching(graph, "torchpar", is_test)


def packaged_test_dirs(pyproject_text):
    """Test packages that pyproject's setuptools `include` patterns would ship."""
    find = tomllib.loads(pyproject_text).get("tool", {}).get("setuptools", {}).get("packages", {})
    return sorted(
        {
            (pat, name)
            for pat in find.get("find", {}).get("include", [])
            for name in ("tests", "parity_tests")
            if fnmatch.fnmatchcase(name, pat)
        }
    )


def long_files(files, limit=MAX_FILE_LINES):
    return sorted((path, n) for path, src in files.items() if (n := len(src.splitlines())) > limit)


def long_functions(source, limit=MAX_FUNCTION_LINES):
    """(name, first line, span) of every def longer than `limit`, nested ones and methods included."""
    return [
        (node.name, node.lineno, span)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (span := node.end_lineno - node.lineno + 1) > limit
    ]


def twin_mismatches(files, twins=TWINS):
    """(folder, file) for every .py file under one twin folder that the other lacks."""
    names = {d: {p[len(d) + 1 :] for p in files if p.startswith(d + "/")} for d in twins}
    shared = set.intersection(*names.values())
    return sorted((d, name) for d in twins for name in names[d] - shared)


# Recomputation (model.remat) is applied from outside the models (issue 45): no model file imports a checkpointing
# module or names a recomputation function, policy or setting
RECOMPUTATION = {
    "checkpoint",
    "remat",
    "checkpoint_policies",
    "REMAT_POLICIES",
    "remat_layers",
    "checkpoint_blocks",
    "CheckpointedBlock",
    "create_selective_checkpoint_contexts",
    "checkpoint_wrapper",
}


def recomputation_in_models(files, folders=TWINS):
    """(model file, module or name) for every checkpointing import and every recomputation name it uses."""
    found = set()
    for path, src in files.items():
        if not path.startswith(tuple(d + "/" for d in folders)):
            continue
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                found.update((path, m) for m in modules if "checkpoint" in m)
                found.update((path, a.name) for a in node.names if a.name in RECOMPUTATION)
            elif isinstance(node, ast.Name) and node.id in RECOMPUTATION:
                found.add((path, node.id))
            elif isinstance(node, ast.Attribute) and node.attr in RECOMPUTATION:
                found.add((path, node.attr))
    return sorted(found)


# What wraps or shards a module or the model's computation, by the name called (its last part, or the whole
# dotted name), and the only files that may call it: the two parallelize modules and what implements their stages
# (torchpar's backends build the wrappers; jaxpar's ops.remat_layers is the one jax.checkpoint). Shipped code only:
# tests assemble pieces on purpose.
_TORCHPAR_STAGES = ("torchpar/parallelize.py",)
_JAXPAR_STAGES = ("jaxpar/parallelize.py",)
WRAPPERS = {
    "checkpoint_blocks": _TORCHPAR_STAGES,
    "compile_blocks": _TORCHPAR_STAGES,
    "backends.build": _TORCHPAR_STAGES,
    "torch.compile": _TORCHPAR_STAGES,
    "checkpoint": _TORCHPAR_STAGES,
    "fully_shard": ("torchpar/backends/",),
    "DDP": ("torchpar/backends/",),
    "PipelineStage": ("torchpar/backends/",),
    "DistributedDataParallel": ("torchpar/backends/",),
    "deepspeed.initialize": ("torchpar/backends/",),
    "jax.checkpoint": ("jaxpar/ops.py",),
    "jax.remat": ("jaxpar/ops.py",),
    "nnx.remat": ("jaxpar/ops.py",),
    "remat_layers": _JAXPAR_STAGES,
    "mesh_context": _JAXPAR_STAGES,
    "gpipe_layers": _JAXPAR_STAGES,
    "sequence_attention": _JAXPAR_STAGES,
    "expert_parallel": _JAXPAR_STAGES,
    "hand_scheduled": _JAXPAR_STAGES,
    "compressed_loss_and_grads": _JAXPAR_STAGES,
    "powersgd_loss_and_grads": _JAXPAR_STAGES,
    "ParallelContext": _JAXPAR_STAGES + ("jaxpar/context.py",),  # context.py: the default, no parallelism
}


def dotted(node) -> str:
    """A call's callee as written: `a.b.c`, `?.compile` where a part is not a name."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return "?"


def wrapped_outside_parallelize(files, wrappers=WRAPPERS):
    """(file, callee) for every call of a wrapper outside the files allowed it.

    In torchpar a `.compile()` without arguments (a module's torch.compile in place) counts as torch.compile.
    """
    found = set()
    for path, src in files.items():
        if not path.startswith(("jaxpar/", "torchpar/")):
            continue
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, ast.Call):
                continue
            name = dotted(node.func)
            last = name.rpartition(".")[2]
            key = name if name in wrappers else last if last in wrappers and "." not in last else None
            if last == "compile" and not node.args and path.startswith("torchpar/"):  # re.compile has a pattern
                key = "torch.compile"
            if key is not None and not path.startswith(wrappers[key]):
                found.add((path, name))
    return sorted(found)


_NAMED_PATH = re.compile(
    r"(?<![\w./-])((?:jaxpar|torchpar|tests|parity_tests|configs|docs|benchmarks|tools)/"
    r"[\w./-]*\.(?:py|md|yaml|sh|json|toml))\b"
)


def missing_paths(texts: dict[str, str], exists=lambda p: (ROOT / p).exists()) -> list[tuple[str, str]]:
    """(file, path) for every repository file a text names (docstrings, comments, docs) that does not exist."""
    return sorted(
        {
            (name, m.group(1))
            for name, text in texts.items()
            for m in _NAMED_PATH.finditer(text)
            if not exists(m.group(1))
        }
    )


def batch_walks(doc: str) -> dict[str, list[str]]:
    """docs/architecture.md's "One batch, in order": {framework: the files of its numbered "(walk)" list}."""
    walks, name = {}, None
    for line in doc.splitlines():
        if line.endswith("(walk):"):
            name = line.split()[0]
            walks[name] = []
        elif name and (m := re.match(r"\d+\. `([\w/.]+\.py)`", line)):
            walks[name].append(m.group(1))
        elif name and line.startswith("#"):
            name = None
    return walks


def walk_violations(walk: list[str], graph, exists=lambda p: (ROOT / p).is_file()) -> list[str]:
    """What breaks a batch's walk: more than ten files, a file twice or missing, a file importing an earlier one."""
    bad = [f"{len(walk)} files"] if len(walk) > 10 else []
    bad += [f"{p} twice" for p in sorted({p for p in walk if walk.count(p) > 1})]
    bad += [f"{p} missing" for p in walk if not exists(p)]
    mods = [module_of(p)[0] for p in walk]
    bad += [f"{walk[i]} imports {walk[j]}" for i, m in enumerate(mods) for j in range(i) if mods[j] in graph.get(m, ())]
    return bad


FILES = load_files()
GRAPH = build_graph(FILES)


def test_no_import_cycles():
    assert not (cycles := find_cycles(GRAPH)), f"import cycles: {cycles}"


def test_models_and_parallel_are_independent():
    pairs = imports_matching(GRAPH, "jaxpar.models", lambda d: under(d, "jaxpar.parallel")) + imports_matching(
        GRAPH, "jaxpar.parallel", lambda d: under(d, "jaxpar.models")
    )
    assert not pairs, f"models <-> parallel imports: {pairs}"


def test_model_twins_mirror_file_for_file():
    assert all((ROOT / d).is_dir() for d in TWINS), f"missing: {TWINS}"
    assert not (bad := twin_mismatches(FILES)), f"models/ files without their twin (folder, file): {bad}"


def test_shared_core_is_framework_free():
    assert (ROOT / "jaxpar" / "core").is_dir(), "jaxpar/core does not exist"
    assert not (bad := core_violations(GRAPH)), f"jaxpar.core imports: {bad}"


def test_torchpar_reads_only_the_shared_core():
    assert not (bad := torchpar_violations(GRAPH)), f"torchpar imports outside jaxpar.core: {bad}"


def test_the_library_imports_no_tool():
    """jaxpar/tools and torchpar/tools are command-line entry points over the library, which never imports them."""
    assert not (bad := tools_violations(GRAPH)), f"the library imports its tools (importer, tool): {bad}"


def test_the_tools_folders_hold_entry_points_only():
    """Every module of jaxpar/tools and torchpar/tools is a command (`python -m ...`); its library lives elsewhere."""
    tools = [p for p in FILES if p.startswith(("jaxpar/tools/", "torchpar/tools/")) and not p.endswith("__init__.py")]
    assert tools and not (bad := [p for p in tools if 'if __name__ == "__main__":' not in FILES[p]]), bad


def test_no_two_files_in_jaxpar_share_a_name():
    """A name says where a concept lives: one `experts.py`, one `checks.py` (torchpar's twins are torchpar's)."""
    assert not (bad := shared_base_names(FILES)), f"file names used twice in jaxpar: {bad}"


def test_shipped_packages_contain_no_test_code():
    assert not (bad := imports_of_test_code(GRAPH)), f"shipped code imports test code: {bad}"
    shipped = packaged_test_dirs((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert not shipped, f"pyproject packages.find include ships (pattern, package): {shipped}"


def test_every_path_a_doc_or_docstring_names_exists():
    docs = {
        str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
        for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    }
    code = {path: src for path, src in FILES.items() if path != "tests/core/test_structure.py"}  # its planted paths
    assert not (bad := missing_paths({**docs, **code})), f"named but missing (file, path): {bad}"


def test_models_hold_no_recomputation():
    """model.remat is applied by jaxpar/parallelize.py and torchpar/parallelize.py, never inside a model file."""
    assert not (bad := recomputation_in_models(FILES)), f"recomputation inside the models (file, name): {bad}"


def test_only_the_parallelize_functions_wrap_or_shard():
    """Only the parallelize modules wrap, compile or shard the model.

    Checkpointing, compiling, the parallel context's strategies, gradient compression and the backends' wrappers are
    applied by the parallelize modules (or the stage modules they call) alone.
    """
    bad = wrapped_outside_parallelize(FILES)
    assert not bad, f"wrapped or sharded outside the parallelize functions (file, call): {bad}"


def test_no_long_files():
    assert not (bad := long_files(FILES)), f"files over {MAX_FILE_LINES} lines: {bad}"


def test_no_long_functions():
    """Outside tests/, every function reads on one screen (the loop and the pipeline executor's body included)."""
    bad = {
        path: found for path, src in FILES.items() if not path.startswith("tests/") and (found := long_functions(src))
    }
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines: {bad}"


def test_one_batch_walks_down_through_few_files():
    """docs/architecture.md states the path of one batch from each entry point.

    The files it names exist, at most ten, each once, and the walk only goes down the imports. The loop that starts
    it reads on a page or so.
    """
    walks = batch_walks((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    assert set(walks) == {"jaxpar", "torchpar"} and all(walks.values()), walks
    assert not (bad := {k: b for k, w in walks.items() if (b := walk_violations(w, GRAPH))}), bad
    assert (lines := FILES["jaxpar/core/run/loop.py"].count("\n")) <= 200, f"jaxpar/core/run/loop.py: {lines} lines"


@pytest.mark.parametrize("path", TRAINERS)
def test_trainers_are_their_arguments_and_an_adapter(path):
    """The run sequence is jaxpar/core/run/loop.py's; a trainer is its argument parsing and its adapter."""
    assert (ROOT / path).is_file(), f"{path} does not exist"
    lines = FILES[path].count("\n")
    assert lines <= MAX_TRAINER_LINES, f"{path}: {lines} lines (at most {MAX_TRAINER_LINES})"
    assert "run_training(" in FILES[path], f"{path} does not hand its adapter to jaxpar.core.run.loop.run_training"


# --- self-checks: each helper must report a violation planted in a tiny in-memory tree ---------

CYCLE = {"p/__init__.py": "from p import a\n", "p/a.py": "def f():\n    from . import b\n", "p/b.py": "import p.a.x\n"}
PLANTED = {
    "cycle inside functions, via relative import": lambda: find_cycles(build_graph(CYCLE)) == [["p.a", "p.b"]],
    "no cycle through an __init__": lambda: find_cycles(build_graph({**CYCLE, "p/b.py": ""})) == [],
    "models imports parallel": lambda: (
        imports_matching(
            build_graph({"jaxpar/models/m.py": "from jaxpar.parallel import seq\n", "jaxpar/parallel/seq.py": ""}),
            "jaxpar.models",
            lambda d: under(d, "jaxpar.parallel"),
        )
        == [("jaxpar.models.m", "jaxpar.parallel.seq")]
    ),
    "a model file without its twin": lambda: (
        twin_mismatches(
            {"jaxpar/models/a.py": "", "torchpar/models/a.py": "", "torchpar/models/stray.py": "", "jaxpar/b.py": ""}
        )
        == [("torchpar/models", "stray.py")]
    ),
    "core imports jax in a function": lambda: (
        core_violations(build_graph({"jaxpar/core/c.py": "def f():\n    import jax.numpy\n"}))
        == [("jaxpar.core.c", "jax.numpy")]
    ),
    "core imports the project": lambda: (
        core_violations(build_graph({"jaxpar/core/c.py": "from .. import mesh\n", "jaxpar/mesh.py": ""}))
        == [("jaxpar.core.c", "jaxpar.mesh")]
    ),
    "torchpar imports the jaxpar package": lambda: (
        torchpar_violations(
            build_graph(
                {
                    "torchpar/t.py": "import jaxpar\nimport jaxpar.core.x\n",
                    "jaxpar/__init__.py": "",
                    "jaxpar/core/x.py": "",
                }
            )
        )
        == [("torchpar.t", "jaxpar")]
    ),
    "the library imports a tool": lambda: (
        tools_violations(
            build_graph(
                {
                    "jaxpar/train.py": "from jaxpar.tools.plan import peak\n",
                    "jaxpar/tools/plan.py": "import jaxpar.cost\n",
                    "jaxpar/cost.py": "",
                    "torchpar/x.py": "def f():\n    import torchpar.tools.bench\n",
                    "torchpar/tools/bench.py": "",
                }
            )
        )
        == [("jaxpar.train", "jaxpar.tools.plan"), ("torchpar.x", "torchpar.tools.bench")]
    ),
    "two files share a name": lambda: (
        shared_base_names(
            {
                "jaxpar/a/experts.py": "",
                "jaxpar/experts.py": "",
                "jaxpar/a/__init__.py": "",
                "jaxpar/__init__.py": "",
                "torchpar/experts.py": "",
            }
        )
        == {"experts.py": ["jaxpar/a/experts.py", "jaxpar/experts.py"]}
    ),
    "shipped code imports pytest": lambda: (
        imports_of_test_code(build_graph({"jaxpar/x.py": "import pytest\n"})) == [("jaxpar.x", "pytest")]
    ),
    "pyproject ships tests": lambda: (
        packaged_test_dirs('[tool.setuptools.packages.find]\ninclude = ["jaxpar*", "parity_tests*"]\n')
        == [("parity_tests*", "parity_tests")]
    ),
    "a doc names a file that is gone": lambda: (
        missing_paths(
            {"a.md": "see jaxpar/gone.py, jaxpar/core/config/schema.py and `docs/gone.md`."},
            lambda p: p == "jaxpar/core/config/schema.py",
        )
        == [("a.md", "docs/gone.md"), ("a.md", "jaxpar/gone.py")]
    ),
    "a batch's walk goes up, repeats, runs long": lambda: (
        walk_violations(
            ["a/x.py", "a/y.py", "a/x.py"] + [f"a/{i}.py" for i in range(8)],
            build_graph({"a/x.py": "", "a/y.py": "import a.x\n"}),
            lambda p: p != "a/7.py",
        )
        == ["11 files", "a/x.py twice", "a/7.py missing", "a/y.py imports a/x.py"]
    ),
    "the walks in a doc": lambda: (
        batch_walks("jaxpar (walk):\n1. `a/x.py` -- x\n   more\n2. `a/y.py`\n\n## Next\n3. `b.py`")
        == {"jaxpar": ["a/x.py", "a/y.py"]}
    ),
    "a model file recomputes": lambda: (
        recomputation_in_models(
            {
                "jaxpar/models/m.py": "import jax\nf = jax.checkpoint(g, policy=REMAT_POLICIES[cfg.remat])\n",
                "torchpar/models/t.py": "from torch.utils.checkpoint import checkpoint\n",
                "jaxpar/ops.py": "jax.checkpoint(f)\n",
            }
        )
        == [
            ("jaxpar/models/m.py", "REMAT_POLICIES"),
            ("jaxpar/models/m.py", "checkpoint"),
            ("jaxpar/models/m.py", "remat"),
            ("torchpar/models/t.py", "checkpoint"),
            ("torchpar/models/t.py", "torch.utils.checkpoint"),
        ]
    ),
    "a module wrapped outside parallelize": lambda: (
        wrapped_outside_parallelize(
            {
                "torchpar/trainer.py": "compile_blocks(model)\nblock.compile()\nx = backends.build('none', m)\n"
                "re.compile('a')\n",
                "torchpar/parallelize.py": "compile_blocks(model)\nblock.compile()\n",
                "tests/t.py": "fully_shard(m)\n",
                "jaxpar/step.py": "f = jax.jit(g).lower(a).compile()\nctx = ParallelContext(mesh)\nr = build(x)\n",
            }
        )
        == [
            ("jaxpar/step.py", "ParallelContext"),
            ("torchpar/trainer.py", "backends.build"),
            ("torchpar/trainer.py", "block.compile"),
            ("torchpar/trainer.py", "compile_blocks"),
        ]
    ),
    "long file": lambda: long_files({"a.py": "x = 1\n" * 401, "b.py": "x = 1\n" * 400}, 400) == [("a.py", 401)],
    "long nested function": lambda: (
        long_functions("class C:\n    def m(self):\n        def inner():\n" + "            pass\n" * 80, 60)
        == [("m", 2, 82), ("inner", 3, 81)]
    ),
}


@pytest.mark.parametrize("case", PLANTED)
def test_helpers_catch_planted_violations(case):
    assert PLANTED[case](), case
