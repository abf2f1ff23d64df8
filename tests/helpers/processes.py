"""Running the repository's scripts as a user would, in processes of their own or under torchrun,
and reading the one line a failure says."""
import os
import signal
import subprocess
import sys

import pytest

from helpers import REPO
from helpers.limits import memory_limit, torch_address_space


def popen_torchrun(*args, nproc=2, torchrun_flags=(), preexec_fn=None):
    """torchrun on CPU (gloo) in its own process group, so a hung run's workers die with it;
    preexec_fn as run_script's (its limits hold for the workers too)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *torchrun_flags, *map(str, args)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=preexec_fn)


def finish_torchrun(proc, timeout=300):
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:  # workers left behind by a failed or timed-out run
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_torchrun(*args, nproc=2, timeout=300, preexec_fn=None):
    return finish_torchrun(popen_torchrun(*args, nproc=nproc, preexec_fn=preexec_fn), timeout)


def said_errors(stderr):
    """The error lines that the ranks of a torchrun run said ("error: ..."), not torchrun's summary,
    which gives one of them again as its root cause (torchrun_root_cause)."""
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def torchrun_root_cause(stderr):
    """The message that torchrun's summary of its failed ranks gives as the root cause (the failure
    of the earliest time)."""
    root = stderr[stderr.index("Root Cause (first observed failure):"):]
    return next(line for line in root.splitlines() if line.startswith("  traceback : "))[len("  traceback : "):]


def run_script(script, *args, cwd=REPO, env=None, timeout=300, preexec_fn=None):
    """Runs one of the repository's scripts (or script, a path) as a user would, offline, with
    env's variables added; returns the CompletedProcess with stdout and stderr as text.
    subprocess.TimeoutExpired past timeout seconds."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": "utf-8", **(env or {})}
    return subprocess.run([sys.executable, os.path.join(REPO, script), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, encoding="utf-8", timeout=timeout, preexec_fn=preexec_fn)


def exit_message(capsys, main, *argv):
    """The one-line error that main(argv) exits with, not 0: argparse-style scripts print it
    to stderr (its last line, after any progress bar), sys.exit(message) passes it as the code."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    assert e.value.code not in (0, None)
    message = e.value.code if isinstance(e.value.code, str) else capsys.readouterr().err.strip().splitlines()[-1]
    assert "\n" not in message
    return message


def one_line_error(result):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def run_bounded(script, *args, cwd=REPO):
    """run_script for inputs that could hang or fill the memory of a script that reads them
    unbounded: 60 s, and 2 GiB beyond what importing torch maps, at most, so that a test of such an
    input fails, never hangs."""
    return run_script(script, *args, cwd=cwd, timeout=60, preexec_fn=memory_limit(torch_address_space() + (2 << 30)))
