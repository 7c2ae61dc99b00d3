"""The suite's xdist groups group: pytest-xdist 3.8 puts a test's group in its node id, which
pytest 9.2 no longer lets it change, and then `--dist loadgroup` spreads a group over the workers
without a word (pyproject.toml keeps pytest below 9.2)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_the_tests_on_ray_session_run_in_one_worker(tmp_path):
    (tmp_path / "conftest.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(TESTS)!r})\n"
        "import pytest\n"
        "from xdist_groups import pytest_collection_modifyitems  # noqa: F401\n"
        "@pytest.fixture\n"
        "def ray_session():\n"
        "    return None\n"
    )
    body = "".join(f"def test_ray_{i}(ray_session):\n    pass\n" for i in range(4))
    (tmp_path / "test_groups.py").write_text(body + "def test_other_1():\n    pass\ndef test_other_2():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    args = ["-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-v", "-rN", "-o", "addopts="]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", *args, str(tmp_path / "test_groups.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    ran = {name: worker for worker, name in re.findall(r"\[(gw\d)\] \[ *\d+%\] PASSED \S*::(\S+)", out.stdout)}
    assert sorted(ran) == ["test_other_1", "test_other_2", *(f"test_ray_{i}@ray" for i in range(4))], out.stdout
    assert len({ran[f"test_ray_{i}@ray"] for i in range(4)}) == 1, ran
