"""What tests/core/test_doc_commands.py checks: every command README.md and the docs show, and how.

Commands come from fenced code blocks and inline code spans that start with `python -m jaxpar.X` (or torchpar,
parity_tests, pytest), `torchrun`, `deepspeed`, `srun` or `./setup.sh`. Nothing is run: each is checked the fast way.

- `python -m MODULE ARGS`: the module's own parser accepts ARGS (its `main`, stopped right after argparse has
  parsed). Then the trainers' configs are loaded with their overrides and validated for their mesh or backend
  without devices (jaxpar/checks.py and torchpar/checks.py `validate`), `jaxpar.tools.launch` makes its own checks
  before the queue, and any other tool that takes `--config` and overrides loads them (with a `--mesh`: the layout).
- `torchrun`, `deepspeed`, `srun`: the launcher's own parser (torch's, DeepSpeed's; srun's options are skipped), then
  the module it starts, with the world size the launcher gives it.
- `python -m pytest ARGS`: pytest's parser with this repository's options (conftest.py files, plugins); the paths
  named exist. `./setup.sh`: there, executable, no arguments.

A placeholder in capitals (DIR, RUN, ...) is filled with its stand-in from STAND_INS; one without a stand-in fails.
A missing `<run>/config.json` (a run that an earlier command writes) stands in as configs/gpt2-124m.yaml. `...`
marks a partial command: the options it shows must exist. A command followed by "(illustrative)" is only checked
to name a module that runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import io
import math
import os
import re
import shlex
import tempfile
from pathlib import Path
from unittest import mock

from jaxpar.core.config.schema import load_config
from jaxpar.core.config.mesh_spec import parse_mesh, resolve_sizes

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(
    ["README.md", *(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")), "docs/benchmarks/README.md"]
)
PROGRAMS = ("python", "python3", "torchrun", "deepspeed", "srun", "./setup.sh")
MODULES = re.compile(r"^(jaxpar|torchpar|parity_tests)(\.\w+)+$|^pytest$")
STAND_INS = {
    "C": "configs/gpt2-tiny.yaml",
    "M": "dp=2,tp=4",
    "S": "1",
    "N": "2",
    "K": "3",
    "MIN": "1",
    "MAX": "2",
    "FILE": "tests/core/test_config.py",
    "PATH": "init.safetensors",
    "W": "w",
    "$OUT": "/tmp/out",
    "DIR": "out/dir",
    "NEW_DIR": "out/new",
    "RUN": "runs/jaxpar/gpt2-tiny",
    "RUN_DIR": "runs/jaxpar/gpt2-tiny",
    "RUN2": "runs/torchpar/gpt2-tiny",
    "GPT2_DIR": "hf/gpt2",
    "LLAMA_DIR": "hf/llama",
    "MIXTRAL_DIR": "hf/mixtral",
    "README": "README",  # README.md: a real file, named in capitals
}
RUN_CONFIG = "configs/gpt2-124m.yaml"  # what a converted Hugging Face GPT-2 run's config.json holds
PARSERS = ("parse_args", "parse_known_args", "parse_intermixed_args", "parse_known_intermixed_args")


@dataclasses.dataclass
class Command:
    where: str  # file:line
    words: list[str]
    illustrative: bool = False
    broken: str = ""  # why the shell could not read it


def shell_words(text: str) -> list[list[str]]:
    """A shell line as commands (split at && ; | and redirections dropped), each without leading VAR=value."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split, lex.commenters = True, "#"
    commands, words, skip = [], [], False
    for word in lex:
        if word in ("&&", "||", ";", "|"):
            commands, words = commands + [words], []
        elif word in (">", ">>", "<", "2>"):
            skip = True
        elif not skip:
            words.append(word)
        else:
            skip = False
    commands.append(words)
    return [ws[next((i for i, w in enumerate(ws) if not re.match(r"^[A-Z_]+=", w)), len(ws)) :] for ws in commands]


def is_command(words: list[str]) -> bool:
    """A program of PROGRAMS.

    Python with -m and one of this repository's modules (or pytest); DeepSpeed's launcher with its options first
    (`deepspeed config: ...` is prose).
    """
    if not words or words[0] not in PROGRAMS:
        return False
    if words[0] == "deepspeed":
        return len(words) == 1 or words[1].startswith("-")
    return words[0] not in ("python", "python3") or (
        len(words) > 2 and words[1] == "-m" and bool(MODULES.match(words[2]))
    )


def commands_of(where: str, line: str, illustrative: bool) -> list[Command]:
    """The commands of one shell line.

    A line that starts with a program but that the shell cannot read is one broken command.
    """
    try:
        return [Command(where, ws, illustrative) for ws in shell_words(line) if is_command(ws)]
    except ValueError as e:  # unbalanced quotes
        words = line.split()
        return [Command(where, words, illustrative, str(e))] if is_command(words) else []


def commands_in(name: str, text: str) -> list[Command]:
    """The commands of fenced blocks (backslash continuations joined) and inline code spans."""
    found = []
    fence = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
    for block in fence.finditer(text):
        number, line, start = text.count("\n", 0, block.start(1)), "", 0
        for raw in block.group(1).splitlines():
            number += 1
            start, line = start if line else number, line + raw.rstrip().removesuffix("\\") + " "
            if raw.rstrip().endswith("\\"):
                continue
            mark = line.rstrip().endswith("# illustrative")
            found += commands_of(f"{name}:{start}", line, mark)
            line = ""
    prose = fence.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for span in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose):
        mark = prose[span.end() :].lstrip().startswith("(illustrative)")
        line = prose.count("\n", 0, span.start()) + 1
        found += commands_of(f"{name}:{line}", " ".join(span.group(1).split()), mark)
    return found


def filled(words: list[str]) -> list[str]:
    """Placeholders replaced by their stand-ins; a placeholder without one is an error."""

    def fill(word: str) -> str:
        word = word.replace("$OUT", STAND_INS["$OUT"])
        for name in re.findall(r"(?<![\w$.-])[A-Z][A-Z0-9_]*(?![\w])", word):
            if name not in STAND_INS:
                raise AssertionError(f"placeholder {name} has no stand-in: write a real value or add it to STAND_INS")
            word = re.sub(rf"(?<![\w$.-]){name}(?![\w])", STAND_INS[name], word)
        return word

    return [fill(w) for w in words]


class Parsed(BaseException):
    """Raised from inside a module's main as soon as argparse is done: nothing after the parse runs."""

    def __init__(self, parser: argparse.ArgumentParser, namespace=None):
        super().__init__()
        self.parser, self.namespace = parser, namespace


@contextlib.contextmanager
def stop_at_parse(parse: bool):
    """While inside, the first parser a main uses raises Parsed: after parsing, or before it (parse=False)."""
    originals, inside = {name: getattr(argparse.ArgumentParser, name) for name in PARSERS}, []

    def stopping(name):
        def method(self, *args, **kwargs):
            if inside:  # argparse's own inner calls (parse_args -> parse_known_args, subparsers)
                return originals[name](self, *args, **kwargs)
            inside.append(name)
            try:
                namespace = originals[name](self, *args, **kwargs) if parse else None
            finally:
                inside.clear()
            raise Parsed(self, namespace)

        return method

    try:
        for name in PARSERS:
            setattr(argparse.ArgumentParser, name, stopping(name))
        yield
    finally:
        for name, method in originals.items():
            setattr(argparse.ArgumentParser, name, method)


def parse(name: str, main, args: list[str], partial: bool):
    """The namespace `main` parses from `args` (None for a partial command, whose options must be the parser's)."""
    err = io.StringIO()
    try:
        with stop_at_parse(parse=not partial), contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
            main(args)
    except Parsed as done:
        if partial:
            known = dict(done.parser._option_string_actions)
            for sub in (a for a in done.parser._actions if isinstance(a, argparse._SubParsersAction)):
                for command in (w for w in args if w in sub.choices):  # a subcommand's own options
                    known.update(sub.choices[command]._option_string_actions)
            unknown = [w for w in args if re.match(r"-[^\d]", w) and w.split("=")[0] not in known]
            assert not unknown, f"{name} has no option {unknown}"
        return done.namespace
    except SystemExit:
        raise AssertionError(f"{name} refuses {shlex.join(args)}: {err.getvalue().strip().splitlines()[-1:]}") from None
    raise AssertionError(f"{name} returned without parsing arguments")


def stand_in_config(path: str | None) -> str | None:
    """--config as given, or RUN_CONFIG for a run's config.json that an earlier command writes."""
    return RUN_CONFIG if path and path.endswith("/config.json") and not os.path.exists(path) else path


def config_of(ns) -> object:
    """The config a parsed command names (--config and overrides)."""
    return load_config(stand_in_config(getattr(ns, "config", None)), list(getattr(ns, "overrides", []) or []))


@contextlib.contextmanager
def in_empty_run_dir(cfg):
    """The config with run.dir in a fresh directory: a resume check reads nothing of this machine's runs/."""
    with tempfile.TemporaryDirectory(prefix="doc-command-") as empty:
        yield dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=empty))


def mesh_sizes(spec: str) -> dict[str, int]:
    """Every axis's size; the -1 axis takes 1 (the smallest machine the mesh fits)."""
    sizes = parse_mesh(spec)
    return resolve_sizes(sizes, math.prod(v for v in sizes.values() if v != -1))


def check_jaxpar(module: str, ns) -> None:
    from jaxpar.checks import check_layout, validate
    from jaxpar.core.data.batch_shapes import for_each_shape
    from jaxpar.core.config.contract import Run, check_contract

    cfg = config_of(ns)
    meshes = ns.mesh if isinstance(getattr(ns, "mesh", None), list) else [getattr(ns, "mesh", None)]
    for spec in meshes:
        sizes = mesh_sizes(spec or cfg.parallel.mesh)
        if module == "jaxpar.train":
            with in_empty_run_dir(cfg) as fresh:
                validate(fresh, sizes)
        elif spec:
            check_contract(Run(cfg, "jaxpar", mesh=sizes))
            for_each_shape(cfg, lambda at: check_layout(at, sizes))


def check_torchpar_train(ns, world: int) -> None:
    from torchpar.checks import resolve_schedule, validate
    from torchpar.train import read_config

    ns.config = stand_in_config(ns.config)
    with mock.patch.dict(os.environ, {"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_RANK": "0"}):
        cfg, _ = resolve_schedule(read_config(ns), ns)
        with in_empty_run_dir(cfg) as fresh:
            validate(fresh, ns)


def check_module(module: str, args: list[str], world: int = 1, illustrative: bool = False) -> None:
    """`python -m module args`, as its program takes it."""
    if module == "pytest":
        return check_pytest(args)
    if illustrative or module == "jaxpar.core.config.schema" or not args:  # a module named, or a parser of its own
        main, out = importlib.import_module(module).main, io.StringIO()
        if module == "jaxpar.core.config.schema" and args:  # prints the resolved config: quick
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                assert main(args) == 0, (
                    f"python -m jaxpar.core.config.schema refuses {shlex.join(args)}: {out.getvalue()}"
                )
        return
    partial = "..." in args
    mod = importlib.import_module(module)
    entry = getattr(mod, "parse_args", mod.main)  # a parser of its own is quicker: no main's teardown after it
    ns = parse(module, entry, [a for a in args if a != "..."], partial)
    if partial:
        return
    if module == "torchpar.train":
        check_torchpar_train(ns, world)
    elif module == "jaxpar.tools.launch":
        importlib.import_module(module).check_launch(ns)
    elif module == "jaxpar.generate":
        importlib.import_module(module).check_decoding(ns)
    elif hasattr(ns, "overrides") and module.startswith(("jaxpar.", "parity_tests.")):
        check_jaxpar(module, ns)
    elif hasattr(ns, "overrides"):
        config_of(ns)


@functools.cache
def pytest_parser():
    """pytest's parser with the options of both test trees' conftest.py files and the installed plugins."""
    from _pytest.config import get_config

    config = get_config(["tests", "parity_tests"])
    config = config.pluginmanager.hook.pytest_cmdline_parse(
        pluginmanager=config.pluginmanager, args=["tests", "parity_tests"]
    )
    return config._parser


def check_pytest(args: list[str]) -> None:
    ns = pytest_parser().parse([a for a in args if a != "..."])  # a UsageError names an unknown option
    missing = [p for p in ns.file_or_dir if not (ROOT / p.split("::")[0]).exists()]
    assert not missing, f"pytest: no such test path {missing}"


def check_launcher(words: list[str], illustrative: bool) -> None:
    """torchrun, deepspeed or srun, then the module they start."""
    program, args = words[0], words[1:]
    if program == "srun":  # its own options, then the program it starts
        inner = next((i for i, w in enumerate(args) if not w.startswith("-")), None)
        return check(args[inner:], illustrative) if inner is not None else None
    if not args:
        return
    partial = "..." in args or all(w.startswith("-") for w in args)  # the launcher's options alone: how it is called
    args = [a for a in args if a != "..."]
    if program == "torchrun":
        from torch.distributed import run

        ns = parse(program, run.parse_args, args, partial)
        if partial:
            return
        nproc = int(ns.nproc_per_node) if str(ns.nproc_per_node).isdigit() else 1
        world, module, rest = nproc * int(str(ns.nnodes).split(":")[-1]), ns.training_script, ns.training_script_args
    else:
        from deepspeed.launcher import runner

        ns = parse(program, runner.parse_args, args, partial)
        if partial:
            return
        world, module, rest = max(ns.num_gpus, 1), ns.user_script, ns.user_args
    assert ns.module, f"{program}: start the trainer as a module (-m / --module)"
    check_module(module, rest, world, illustrative)


def check(words: list[str], illustrative: bool = False) -> None:
    """One command of the docs, as its program takes it; an AssertionError, SystemExit or UserError says why not."""
    words = filled(words)
    if words[0] in ("python", "python3"):
        return check_module(words[2], words[3:], 1, illustrative)
    if words[0] == "./setup.sh":
        assert os.access(ROOT / "setup.sh", os.X_OK) and len(words) == 1, "./setup.sh: there, executable, no arguments"
        return
    check_launcher(words, illustrative)


def problems(commands: list[Command]) -> list[str]:
    """Each refused command with why, every command checked from the repository's root (as the docs run them)."""
    found, cwd = [], os.getcwd()
    os.chdir(ROOT)
    try:
        for command in commands:
            found += problem(command)
    finally:
        os.chdir(cwd)
    return found


def problem(command: Command) -> list[str]:
    """[why `command` is refused], or []."""
    if command.broken:
        return [f"{command.where}: {' '.join(command.words)}\n    the shell cannot read it: {command.broken}"]
    try:
        check(command.words, command.illustrative)
    except (AssertionError, SystemExit, Exception) as e:  # UserError, pytest's UsageError, argparse's errors
        return [f"{command.where}: {shlex.join(command.words)}\n    {type(e).__name__}: {e}"]
    return []


def slugs(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens, -1, -2, ...

    after a repeat.
    """
    repeats: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(f"{slug}-{repeats[slug]}" if slug in repeats else slug)
        repeats[slug] = repeats.get(slug, 0) + 1
    return anchors
