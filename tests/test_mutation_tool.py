"""``tools/mutation.py`` tests the mutated copy, not the editable install.

The tool applies each mutant to a private copy of the tree and runs the tests in a child
process (``--run-tests``) that maps ``deviceops`` and its sub-packages to the copy's folders.
If anything imports ``deviceops`` before that mapping, the child silently tests the
unmutated install and every mutant of the core survives; this test would see it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("deviceops", "scheduling", "graphs", "kernels", "nn")

PROBE = '''
import deviceops, deviceops.scheduling, deviceops.kernels, deviceops.nn

def test_imports_come_from_the_copy():
    for mod in (deviceops, deviceops.scheduling, deviceops.kernels, deviceops.nn):
        assert mod.__file__.startswith({root!r}), (mod.__name__, mod.__file__)
'''


def test_the_test_child_imports_the_copy(tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for d in (*PACKAGE_DIRS, "tools"):
        shutil.copytree(ROOT / d, copy / d, ignore=ignore)
    (copy / "tests").mkdir()
    (copy / "tests" / "test_probe.py").write_text(PROBE.format(root=str(copy)))
    env = {**os.environ, "DEVICEOPS_DEVICE": "cpu", "PYTHONDONTWRITEBYTECODE": "1"}
    p = subprocess.run([sys.executable, str(copy / "tools" / "mutation.py"), "--run-tests",
                        str(copy), "--", "tests/test_probe.py", "-q", "-p", "no:cacheprovider",
                        "-o", "addopts="], cwd=copy, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    assert "1 passed" in p.stdout, p.stdout[-2000:]
