"""The README's Python examples, run in order as a newcomer pastes them into one session: an
example that no longer runs against the code is a broken first contact."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from cachelab.paths import REPO_ROOT

BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_readme_python_examples_run_in_order(tmp_path):
    blocks = BLOCK.findall((REPO_ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(blocks) >= 2, "the README's Python examples went missing"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    res = subprocess.run([sys.executable, "-c", "\n".join(blocks)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("hits of") == 2
