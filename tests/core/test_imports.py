"""Imports inside functions only where a heavy or optional dependency is deferred, and each says which (issue 58).

Checked on the AST and the comments alone (no project, jax or torch imports), as tests/core/test_structure.py does:
every import inside a function body in jaxpar/ and torchpar/ carries `# deferred: <what and why>` on its line (the
opening line of a parenthesised import), and no module-level import carries one. The self-checks at the bottom run
the helpers on tiny in-memory sources to prove they can fail.
"""

import ast
import functools
import io
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("jaxpar", "torchpar")
DEFERRED = re.compile(r"#\s*deferred:\s*\S")


FILES = {
    p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
    for d in PACKAGES
    for p in sorted((ROOT / d).rglob("*.py"))
}


@functools.cache
def comments(source: str) -> dict[int, str]:
    """{line: its comment} of a source (real comments only: a '#' inside a string is not one)."""
    return {
        tok.start[0]: tok.string
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }


@functools.cache
def imports(source: str) -> tuple[list[ast.stmt], list[ast.stmt]]:
    """(imports inside a function body, every other import) of a source, in line order."""
    tree = ast.parse(source)
    inner = {
        id(node): node
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(fn)
        if isinstance(node, (ast.Import, ast.ImportFrom))
    }
    every = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    by_line = lambda nodes: sorted(nodes, key=lambda n: n.lineno)
    return by_line(inner.values()), by_line(n for n in every if id(n) not in inner)


def undeclared_deferrals(files: dict[str, str]) -> list[tuple[str, int, str]]:
    """(file, line, import) of every import inside a function without `# deferred: ...` on its (opening) line."""
    found = []
    for path, src in files.items():
        notes = comments(src)
        found += [
            (path, node.lineno, ast.unparse(node))
            for node in imports(src)[0]
            if not DEFERRED.match(notes.get(node.lineno, ""))
        ]
    return sorted(found)


def deferred_at_module_level(files: dict[str, str]) -> list[tuple[str, int, str]]:
    """(file, line, import) of every import outside a function that still says `# deferred:` (hoisted since)."""
    found = []
    for path, src in files.items():
        notes = comments(src)
        found += [
            (path, node.lineno, ast.unparse(node))
            for node in imports(src)[1]
            if DEFERRED.match(notes.get(node.lineno, ""))
        ]
    return sorted(found)


def test_every_import_inside_a_function_says_why_it_is_deferred():
    assert FILES and all(p.startswith(PACKAGES) for p in FILES)
    bad = undeclared_deferrals(FILES)
    assert not bad, (
        "imports inside functions without `# deferred: <what and why>` on their line (move them to the "
        f"module's imports, or say which heavy or optional dependency waits): {bad}"
    )


def test_no_module_level_import_says_deferred():
    assert not (bad := deferred_at_module_level(FILES)), f"module-level imports marked deferred: {bad}"


# --- self-checks: each helper must report a violation planted in a tiny in-memory source ---------

PLANTED_SOURCE = '''import os  # deferred: stale

def f():
    """import json  # deferred: only a string"""
    import json
    import math  # deferred: math, for the test
    from a import (  # deferred: a, for the test
        b, c)
    from d import (
        e)  # deferred: on the wrong line

class C:
    def m(self):
        def inner():
            import re
        text = "# deferred: not a comment"; import sys
'''
PLANTED = {
    "an undeclared import, nested ones and a string that only looks like the comment": lambda: (
        undeclared_deferrals({"p/x.py": PLANTED_SOURCE})
        == [
            ("p/x.py", 5, "import json"),
            ("p/x.py", 9, "from d import e"),
            ("p/x.py", 15, "import re"),
            ("p/x.py", 16, "import sys"),
        ]
    ),
    "a declared module is clean": lambda: (
        undeclared_deferrals({"p/y.py": "import os\n\ndef f():\n    import jax  # deferred: jax, for the test\n"}) == []
    ),
    "a comment without a reason does not count": lambda: (
        undeclared_deferrals({"p/z.py": "def f():\n    import jax  # deferred:\n"}) == [("p/z.py", 2, "import jax")]
    ),
    "a module-level import marked deferred": lambda: (
        deferred_at_module_level({"p/x.py": PLANTED_SOURCE}) == [("p/x.py", 1, "import os")]
    ),
}


@pytest.mark.parametrize("case", PLANTED)
def test_helpers_catch_planted_violations(case):
    assert PLANTED[case](), case
