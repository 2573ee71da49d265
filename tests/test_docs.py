"""What the docs name is there: every flag a documented `spindle COMMAND ...` line passes is one that
command parses, every bench script imports, every test cited by name and every path named exists.
A platform team copies these lines; a renamed flag or function left in them fails at their first try.

The dated logs (docs/gpu-notebook.md, docs/performance-notes.md) record what was run then and are
not checked.
"""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

from spindle import cli

ROOT = Path(__file__).resolve().parents[1]
LOGS = {"gpu-notebook.md", "performance-notes.md"}
DOCS = [ROOT / "README.md", ROOT / "helm/spindle/README.md"] + [
    p for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in LOGS
]
PROJECT = {"model_service", "gateway", "adapter_service", "spindle", "bench", "tests"}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# a command line (`spindle serve ...`, `.venv/bin/spindle serve ...`) or an inline span `spindle ...`
COMMAND_LINE = re.compile(r"^\s*(?:\S*/)?spindle ([a-z-]+)(.*)$")
COMMAND_SPAN = re.compile(r"`spindle ([a-z-]+)([^`]*)`")


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and of its subcommands (`spindle adapters pin --off`)."""
    found = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _flags(sub)
    return found


def _joined_lines(text: str) -> list[tuple[int, str]]:
    """The doc's lines with shell continuations (`\\` at the end) joined, each with its number."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        start, line = i, lines[i]
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i]
        out.append((start + 1, line))
        i += 1
    return out


def _documented_commands() -> list[tuple[str, str, str]]:
    """(where, command, the rest of its line up to a comment or the next command) for every
    `spindle COMMAND` the docs show."""
    found = []
    for doc in DOCS:
        for number, line in _joined_lines(doc.read_text()):
            where = f"{doc.relative_to(ROOT)}:{number}"
            whole = COMMAND_LINE.match(line)
            if whole:
                found.append((where, whole.group(1), re.split(r"\s#|\s\|\s", whole.group(2))[0]))
            found += [(where, m.group(1), m.group(2)) for m in COMMAND_SPAN.finditer(line)]
    return [f for f in found if f[1] in cli._COMMANDS]


def test_every_flag_on_a_documented_command_line_is_one_that_command_parses():
    commands = _documented_commands()
    assert len(commands) > 30, "the docs' command lines were not found"
    known = {name: _flags(cli.command_parser(name)[1]) for name in {c for _, c, _ in commands}}
    wrong = [
        f"{where}: spindle {command} {flag}"
        for where, command, rest in commands
        for flag in FLAG.findall(rest)
        if flag not in known[command]
    ]
    assert not wrong, f"flags the docs pass that the command does not take: {wrong}"


@pytest.mark.parametrize("path", sorted((ROOT / "bench").glob("*.py")), ids=lambda p: p.stem)
def test_every_bench_script_imports(path):
    """A bench the docs point at that imports a name the project no longer has fails at its first
    line (bench/tp_control.py imported batch_builder._sizes long after it was gone). Optional
    third-party libraries (triton on a CPU box, xgrammar) skip."""
    try:
        importlib.import_module(f"bench.{path.stem}")
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in PROJECT:
            raise
        pytest.skip(f"needs {e.name}")


def test_every_test_the_docs_cite_exists():
    tests = {p.name: p.read_text() for p in (ROOT / "tests").glob("test_*.py")}
    everywhere = "\n".join(tests.values())
    cited = re.compile(r"(?:(test_\w+\.py)::)?(test_[a-z0-9_]+)(?![a-z0-9_]|\.py)(\.\.\.)?")
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for m in cited.finditer(text):
            file, name, prefix = m.groups()
            if name.endswith("_") or prefix:  # `test_lying_uploads_...`: a prefix
                name = name.rstrip("_")
                pattern = rf"def {re.escape(name)}"
            else:
                pattern = rf"def {re.escape(name)}\b"
            if (ROOT / "tests" / f"{name}.py").exists() or re.search(pattern, tests.get(file, everywhere)):
                continue
            missing.append(f"{doc.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0)}")
    assert not missing, f"tests the docs cite that do not exist: {missing}"


# a path in the repository: a top-level package or folder, then a file with one of these endings or a
# folder (`gateway/router.py`, `helm/spindle/`); `spindle/peft.target_refusal` (a name) is not one
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:model_service|gateway|adapter_service|spindle|bench|scripts|tests|docs|helm|docker|"
    r"protos|adapters)/[\w./-]*?(?:\.(?:py|sh|md|proto|yaml|json|Dockerfile)|/))(?![\w-])"
)


def test_every_path_the_docs_name_exists():
    """A file or folder the docs send a reader to (`spindle/openai_api/fanout.py`, `helm/spindle/`)
    is there, relative to the repository or to the doc itself: a moved or renamed module leaves
    no dead pointer."""
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for m in REPO_PATH.finditer(text):
            path = m.group(1)
            if not ((ROOT / path).exists() or (doc.parent / path).exists()):
                missing.append(f"{doc.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}: {path}")
    assert not missing, f"paths the docs name that do not exist: {missing}"
