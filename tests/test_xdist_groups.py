"""The suite's xdist groups group (`tests/test_cli_inputs.py`'s runs share one worker, so one
process imports tidal for them all): pytest-xdist 3.8 puts a test's group in its node id, which
pytest 9.2 no longer lets it change, and then `--dist loadgroup` spreads a group over the workers
without a word (pyproject.toml keeps pytest below 9.2)."""

from __future__ import annotations

import os
import re
import subprocess
import sys


def test_the_tests_of_one_group_run_in_one_worker(tmp_path):
    tests = "".join(f"@pytest.mark.xdist_group('forks')\ndef test_grouped_{i}():\n    pass\n" for i in range(4))
    (tmp_path / "test_groups.py").write_text(
        f"import pytest\n{tests}def test_other_1():\n    pass\ndef test_other_2():\n    pass\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    args = ["-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-v", "-o", "addopts="]
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
    grouped = [f"test_grouped_{i}@forks" for i in range(4)]
    assert sorted(ran) == [*grouped, "test_other_1", "test_other_2"], out.stdout
    assert len({ran[name] for name in grouped}) == 1, ran
