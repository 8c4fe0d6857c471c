"""Long work shows progress under --json too: bars and spinners go to standard error and are
drawn where it is a terminal, while standard output stays the one JSON object."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import numpy as np


def _run_with_terminal_stderr(args: list[str], cwd) -> tuple[str, str]:
    """Run the CLI with standard error on a pseudo-terminal and standard output on a pipe."""
    leader, follower = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([sys.executable, "-m", "cachelab.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=follower, stdin=subprocess.DEVNULL)
    os.close(follower)
    seen = bytearray()
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the follower side closed: the process has exited
            break
        if not chunk:
            break
        seen += chunk
    out = proc.stdout.read().decode()
    assert proc.wait(timeout=120) == 0, seen.decode(errors="replace")
    os.close(leader)
    return out, seen.decode(errors="replace")


def test_json_runs_show_their_progress_on_a_terminal_and_print_clean_json(tmp_path):
    """``--json`` silenced every bar and spinner (a 12-minute `serve-sim --json` on Mooncake's
    conversation trace printed nothing until it ended)."""
    keys = np.random.default_rng(0).zipf(1.2, 200_000) % 5_000
    np.save(tmp_path / "k.npy", keys)
    out, err = _run_with_terminal_stderr(
        ["simulate", "--trace", "k.npy", "--policy", "lru", "--capacity", "100", "--json"], tmp_path)
    assert json.loads(out)["requests"] == keys.size  # stdout: the one JSON object, nothing else
    assert "reading" in err and "replay" in err, err  # the spinner and the replay's bar, on the terminal


def test_nothing_is_drawn_where_no_terminal_is(tmp_path):
    """A script's stderr (a pipe or a log file) gets no bars, and stdout none of their traces: the
    replay's bar was on stdout, and off a terminal rich ended it with a blank line there."""
    np.save(tmp_path / "k.npy", np.arange(1000) % 50)
    args = [sys.executable, "-m", "cachelab.cli", "simulate", "--trace", "k.npy", "--policy", "lru", "--capacity", "10"]
    res = subprocess.run([*args, "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and json.loads(res.stdout)["requests"] == 1000
    assert res.stderr == "", res.stderr
    res = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("k.npy: a key trace"), res.stdout


def test_a_display_off_a_terminal_draws_nothing_but_prints_its_lines(tmp_path):
    """Off a terminal a bar or spinner is ``cachelab.progress``'s stand-in (Rich not imported for
    it), which keeps its tasks and draws nothing; a line printed through its console (``pareto``'s
    "running ..." for a log) still reaches standard error."""
    probe = """
import sys
from cachelab.progress import progress_bar, spinner
with progress_bar() as bar:
    task = bar.add_task("replay", total=2)
    bar.advance(task)
    bar.update(task, description="done")
    bar.remove_task(task)
drawn = "rich" in sys.modules
with spinner("the grid") as status:
    status.update("running a")
    status.console.print("running a")
print(task, drawn)
"""
    env = {k: v for k, v in os.environ.items()
           if k not in ("FORCE_TERMINAL", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "0 False\n" and res.stderr == "running a\n", (res.stdout, res.stderr)
