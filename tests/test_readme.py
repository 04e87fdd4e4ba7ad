"""The README and docs/ say only what is true of the command line, and their links resolve.

Every ``mlxq COMMAND --flag`` in a shell block or an inline code span of README.md and
docs/*.md must name a command ``mlxq --help`` lists and flags that command's ``--help``
lists (a value given to a choice flag must be one of its choices); every relative link
must reach a file, and every ``#anchor`` a heading of the file it points into.
"""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from mlxq.cli.main import cli

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)
SHELL_FENCES = {"sh", "bash", "shell", "console"}
INLINE = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")
# `mlxq CMD`, also as .venv/bin/mlxq or python -m mlxq; not ~/.mlxq/ or mlxq.serializer
INVOCATION = re.compile(r"(?<![\w.-])mlxq[ \t]+([a-z][a-z-]*)((?:[ \t]+\S+)*)")
ENDS = {"|", "||", "&&", ";", ">", "2>", "&"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$", re.M)


def shell_text(markdown: str) -> list[str]:
    """The command lines a reader would type: shell blocks (comments dropped) and inline
    code spans outside any fenced block."""
    found: list[str] = []
    for lang, body in FENCE.findall(markdown):
        if lang in SHELL_FENCES:
            found += [re.sub(r"(^|\s)#.*", "", line) for line in body.splitlines()]
    prose = FENCE.sub("", markdown)
    found += [" ".join(span.split()) for span in INLINE.findall(prose)]
    return found


def problems(line: str) -> list[str]:
    """What in ``line`` the command line would refuse: unknown commands, flags, choices."""
    out = []
    for name, rest in INVOCATION.findall(line):
        command = cli.commands.get(name)
        if command is None:
            out.append(f"{line!r}: no command `mlxq {name}`")
            continue
        tokens: list[str] = []
        for token in rest.split():
            if token in ENDS or token.startswith("#"):
                break
            tokens.append(token)
        out += [f"{line!r}: {p}" for p in _flag_problems(command, tokens)]
    return out


def _flag_problems(command: click.Command, tokens: list[str]) -> list[str]:
    options = {
        opt: p
        for p in command.params
        if isinstance(p, click.Option)
        for opt in [*p.opts, *p.secondary_opts]
    }
    options.update(dict.fromkeys(["-h", "--help"]))
    out = []
    for i, token in enumerate(tokens):
        if not token.startswith("-") or token == "-":
            continue
        flag, _, inline_value = token.partition("=")
        if flag not in options:
            out.append(f"`mlxq {command.name}` has no option {flag}")
            continue
        param = options[flag]
        value = inline_value or (tokens[i + 1] if i + 1 < len(tokens) else "")
        if param is not None and isinstance(param.type, click.Choice) and _concrete(value):
            choices = {str(c).lower() for c in param.type.choices}
            bad = [v for v in value.split("|") if v.lower() not in choices]
            if bad:
                out.append(f"{flag} takes {sorted(choices)}, not {bad}")
    return out


def _concrete(value: str) -> bool:
    """A value written out, not a placeholder (FILE, …) or another flag."""
    return bool(value) and not value.startswith("-") and "…" not in value and "..." not in value


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def link_problems(path: Path) -> list[str]:
    out = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            out.append(f"{path.name}: link to {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{path.name}: link to {target}: no such heading in {dest.name}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_and_flag_shown_exists(page: Path):
    lines = shell_text(page.read_text())
    assert page.name != "README.md" or sum("mlxq " in line for line in lines) > 50
    found = [p for line in lines for p in problems(line)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page: Path):
    found = link_problems(page)
    assert not found, "\n".join(found)


def test_the_checks_catch_what_is_wrong(tmp_path: Path):
    assert problems("mlxq run x.jsonl --no-such-flag -o out.jsonl")
    assert problems("mlxq frobnicate x")
    assert problems("mlxq results B --format xml")
    assert not problems("mlxq results B --format csv|parquet --with-input -o x.csv")
    assert not problems("MLXQ_API_KEYS=k mlxq dashboard --host 0.0.0.0  # --bogus after #")
    assert not problems("mlxq submit f --temp 0.5 | mlxq-something --bogus")
    page = tmp_path / "p.md"
    page.write_text("# A `b` (c)\n[ok](#a-b-c) [bad](#nope) [gone](missing.md)\n")
    assert len(link_problems(page)) == 2


def test_the_tiny_profile_says_how_to_create_its_model():
    profile = (ROOT / "workers" / "linux-cpu-tiny.toml").read_text()
    assert 'model = "models/tiny"' in profile
    assert "mlxq make-model models/tiny --preset tiny" in " ".join(
        line.lstrip("# ") for line in profile.splitlines()
    )
