"""The command lines the docs show, held to the CLI: a verb or flag renamed in the code and left in
a page (docs/bench.md named a `cachelab experiment run` there never was) sends a reader to an
error. Expensive commands are not run; their verbs and flags are checked against the parser."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import typer

from cachelab.cli import app
from cachelab.paths import REPO_ROOT

PAGES = sorted([REPO_ROOT / "README.md", *(REPO_ROOT / "docs").glob("*.md"), *(REPO_ROOT / "examples").glob("*/README.md")])
SHELL_BLOCK = re.compile(r"^```(bash|sh|console|)\n(.*?)^```", re.S | re.M)  # unlabelled: text or commands
ANY_BLOCK = re.compile(r"^```.*?^```", re.S | re.M)
SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")  # a span may wrap a line
COMMAND = re.compile(r"(?:^|[\s(])(?:\.venv/bin/)?cachelab ((?:[a-z][a-z-]*)(?: [a-z][a-z-]*)*)(.*?)(?=(?:\.venv/bin/)?cachelab |[;|&#]|$)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _command_lines(text: str) -> list[str]:
    """Lines of shell blocks (continuations joined; of an unlabelled block, those that start with a
    command) and inline code spans outside any block."""
    lines = [line for label, block in SHELL_BLOCK.findall(text) for line in block.replace("\\\n", " ").splitlines()
             if label or re.match(r"\s*(?:\.venv/bin/)?cachelab ", line)]
    spans = [span.replace("\\|", "/") for span in SPAN.findall(ANY_BLOCK.sub("", text))]  # a table's a\|b
    return lines + [" ".join(span.split()) for span in spans]


def _unknown(line: str, root) -> list[str]:
    """What of ``line``'s cachelab command lines the CLI does not have: a verb, or a flag of it."""
    wrong = []
    for m in COMMAND.finditer(line):
        words, command, path = m.group(1).split(), root, []
        for word in words:
            sub = getattr(command, "commands", {}).get(word)
            if sub is None:
                break
            command, path = sub, path + [word]
        if not path or (getattr(command, "commands", None) and len(words) > len(path)):
            wrong.append(f"no verb 'cachelab {' '.join(words[:len(path) + 1])}'")
            continue
        if getattr(command, "commands", None):  # a group named alone: `cachelab trace`
            continue
        flags = {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
        rest = " ".join(words[len(path):]) + " " + m.group(2)
        wrong += [f"'cachelab {' '.join(path)}' has no {f}" for f in FLAG.findall(rest) if f not in flags]
    return wrong


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_every_command_a_page_shows_has_its_verb_and_flags(page):
    root = typer.main.get_command(app)
    wrong = [f"{w}: {line.strip()[:100]}" for line in _command_lines(page.read_text(encoding="utf-8"))
             for w in _unknown(line, root)]
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_a_stale_verb_and_flag():
    root = typer.main.get_command(app)
    assert _unknown("cachelab experiment run spec.toml", root) == ["no verb 'cachelab experiment'"]
    assert _unknown(".venv/bin/cachelab store bench --dir D --nope 1", root) == ["'cachelab store bench' has no --nope"]
    text = "```bash\ncachelab simulate --trace T \\\n  --bogus 3\n```\n`cachelab trace` and `cachelab mrc --capacities 1`"
    assert [w for line in _command_lines(text) for w in _unknown(line, root)] == ["'cachelab simulate' has no --bogus"]


def test_the_plugin_examples_commands_run_as_written(tmp_path):
    """examples/plugin-example/README.md's commands (its install aside), pasted into a fresh folder:
    its simulate read a keys.npy that nothing made."""
    text = (REPO_ROOT / "examples" / "plugin-example" / "README.md").read_text(encoding="utf-8")
    lines = [line for _, block in SHELL_BLOCK.findall(text) for line in block.splitlines()
             if line.strip() and not line.startswith("pip install")]
    pytest.importorskip("cachelab_plugin_example", reason="scripts/setup installs examples/plugin-example")
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    said = []
    for line in lines:
        res = subprocess.run(line, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, (line, res.stdout[-1000:], res.stderr[-2000:])
        said.append(res.stdout)
    simulated = [json.loads(out) for line, out in zip(lines, said) if line.startswith("cachelab simulate")]
    assert simulated and simulated[0]["policy"] == "example-random" and simulated[0]["requests"] > 0
