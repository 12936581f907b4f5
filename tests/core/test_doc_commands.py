"""Every command that README.md and the docs show is one its program accepts (how: tests/core/doc_commands.py).

README.md's first screen is what CI runs; the docs' index and links reach their pages and headings.
"""

from __future__ import annotations

import os
import re

import pytest

from tests.core.doc_commands import DOCS, ROOT, commands_in, problems, slugs


@pytest.mark.parametrize("doc", DOCS)
def test_every_command_in_the_doc_is_accepted(doc):
    commands = commands_in(doc, (ROOT / doc).read_text(encoding="utf-8"))
    assert commands or doc.startswith("docs/") and doc != "docs/README.md", f"{doc} shows no command"
    assert not (bad := problems(commands)), "\n".join(bad)
    assert sum(c.illustrative for c in commands) <= 2, f"{doc}: more than two commands marked illustrative"


def test_ci_runs_the_readme_commands_as_the_readme_writes_them():
    """The README's first screen holds setup + the first run, and the tests; .ci/run runs exactly those lines."""
    head = "\n".join((ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:40])
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    for line in (
        "./setup.sh && python -m jaxpar.train --config configs/gpt2-tiny.yaml --mesh dp=2,tp=4",
        "python -m pytest",
    ):
        assert f"\n{line}\n" in head, f"README.md's first 40 lines do not show {line!r}"
        assert line in ci, f".ci/run does not run {line!r} as the README writes it"


def test_the_docs_index_links_every_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    linked = {os.path.normpath(os.path.join("docs", t)) for t in re.findall(r"\]\(([^)#\s]+)", index)}
    pages = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")} - {"docs/README.md"}
    pages |= {"docs/benchmarks/README.md", "docs/parity-report/report.md"}
    assert not (pages - linked), f"docs/README.md does not link {sorted(pages - linked)}"
    assert "docs/README.md" in (ROOT / "README.md").read_text(encoding="utf-8"), "README.md does not link the index"


def test_anchors_are_github_s():
    doc = "# A\n## Planner, benchmarks and plots\n```\n# not a heading\n```\n### `model.x` (the key)\n## A\n"
    assert slugs(doc) == {"a", "planner-benchmarks-and-plots", "modelx-the-key", "a-1"}


def test_links_between_the_docs_reach_a_page_and_a_heading():
    bad = []
    for doc in DOCS:
        text = (ROOT / doc).read_text(encoding="utf-8")
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path = (ROOT / doc).parent / target if target else ROOT / doc
            if not path.exists():
                bad.append(f"{doc}: {target} does not exist")
            elif anchor and path.suffix == ".md" and anchor not in slugs(path.read_text(encoding="utf-8")):
                bad.append(f"{doc}: {target or doc}#{anchor} names no heading")
    assert not bad, "\n".join(bad)


# Planted commands: each must be refused, so that a changed command line fails the test above.
REFUSED = [
    "python -m jaxpar.train --confg configs/gpt2-tiny.yaml",  # a misspelt flag
    "python -m jaxpar.train --config configs/gpt2-tiny.yaml trian.steps=3",  # an unknown key
    "python -m jaxpar.train --config configs/gpt2-124m.yaml --mesh dp=-1,tp=8",  # 12 heads over tp=8
    "python -m jaxpar.train --config configs/gpt2-tiny.yaml parallel.zero_stage=1",  # consumed by nothing on dp=1
    "python -m jaxpar.tools.launch --elastic 2:4 --nodes 4 --gpus-per-node 8 --time 1:00:00 --partition gpu "
    "--config configs/gpt2-124m.yaml --mesh dp=-1,tp=4",  # a global batch of 64 over 6 data ways at 3 nodes
    "torchrun --nproc_per_node=2 -m torchpar.train --config configs/gpt2-tiny.yaml --backend ddp parallel.zero_stage=2",
    "torchrun --nproc_per_node=2 -m torchpar.train --config configs/gpt2-tiny.yaml --backend tp",
    "python -m jaxpar.tools.convert --from jaxpar RUN --to tensorflow out",
    "python -m jaxpar.tools.plan --config configs/gpt2-tiny.yaml --mesh dp=2,tp=8",
    "python -m jaxpar.data prepare --outfile data/x.bin texts/",
    "python -m jaxpar.tools.bench --nodes 3 ...",  # a partial command with an option the tool lacks
    "python -m jaxpar.data prepare --formats sft ...",  # and one of a subcommand
    "python -m pytest --no-such-option",
    "python -m pytest tests/core/no_such_tests",
    "python -m jaxpar.no_such_module --x",
    "python -m jaxpar.generate --run RUN --prompt x --top-p 2",
    "python -m jaxpar.train --config PLACE/config.yaml",  # a placeholder without a stand-in
    "./setup.sh --gpu",
]


@pytest.mark.parametrize("command", REFUSED)
def test_a_changed_command_line_is_refused(command):
    assert problems(commands_in("planted", f"`{command}`")), f"accepted: {command}"


def test_commands_are_found_where_the_docs_write_them():
    text = (
        "Run `python -m jaxpar.train --config C` (illustrative) or\n```bash\nXLA_FLAGS=--x python3 -m jaxpar.tools"
        ".bench \\\n    --mesh dp=1 > out.txt  # a comment\ntorchrun --nproc_per_node=2 -m torchpar.train && ls\n"
        "error: not a command\n```\nand `deepspeed.initialize`, `python -m pip install x`, `srun`."
    )
    found = [(c.where, c.words, c.illustrative) for c in commands_in("t.md", text)]
    assert found == [
        ("t.md:3", ["python3", "-m", "jaxpar.tools.bench", "--mesh", "dp=1"], False),
        ("t.md:5", ["torchrun", "--nproc_per_node=2", "-m", "torchpar.train"], False),
        ("t.md:1", ["python", "-m", "jaxpar.train", "--config", "C"], True),
        ("t.md:8", ["srun"], False),
    ]
