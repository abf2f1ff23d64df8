"""conftest.py's temporary directory of the tests: kept, and said so, only where there is something
to look at."""
import os
import subprocess
import sys

import pytest

from helpers import REPO


def run_pytest(tmpdir, *args):
    """pytest in a process of its own, under the repository's pytest.ini and conftest.py, one process,
    its temporary directory made in tmpdir."""
    command = [sys.executable, "-m", "pytest", "-c", os.path.join(REPO, "pytest.ini"), "-p", "conftest", "-n", "0",
               *map(str, args)]
    return subprocess.run(command, cwd=REPO, env={**os.environ, "TMPDIR": str(tmpdir)}, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_the_tests_temporary_files_are_kept_after_a_failure_only(tmp_path):
    """A path that does not exist is said so, and leaves nothing: not "kept", as after a failure.
    A test that fails leaves the directory, and pytest says where and why."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    result = run_pytest(tmpdir, tmp_path / "test_nope.py")
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert f"file or directory not found: {tmp_path / 'test_nope.py'}" in result.stderr
    assert "kept" not in result.stdout + result.stderr and os.listdir(tmpdir) == []
    (tmp_path / "test_fails.py").write_text("def test_fails():\n    assert 1 == 2\n")
    result = run_pytest(tmpdir, tmp_path / "test_fails.py")
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout + result.stderr
    kept = os.listdir(tmpdir)
    assert len(kept) == 1 and kept[0].startswith("gpt2-tests-")
    assert f"a test failed: the tests' temporary files are kept in {tmpdir / kept[0]}" in result.stdout
