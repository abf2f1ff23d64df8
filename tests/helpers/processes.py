"""Running the repository's scripts as a user would, in processes of their own, on ranks started
in-test or under torchrun, and reading the one line a failure says."""
import multiprocessing
import multiprocessing.connection
import os
import runpy
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import pytest

from helpers import REPO
from helpers.limits import memory_limit, torch_address_space


def popen_torchrun(*args, nproc=2, torchrun_flags=(), env=None):
    """torchrun on CPU (gloo) in its own process group, so a hung run's workers die with it; env:
    its environment, if not the one this process's children inherit."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *torchrun_flags, *map(str, args)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)


def finish_torchrun(proc, timeout=300):
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:  # workers left behind by a failed or timed-out run
        kill_group(proc.pid)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_torchrun(*args, nproc=2, timeout=300):
    return finish_torchrun(popen_torchrun(*args, nproc=nproc), timeout)


def wait_for_line(proc, prefix):
    """Reads proc's stdout (a Popen's, as text) up to the first line that starts with prefix."""
    for line in proc.stdout:
        if line.startswith(prefix):
            return
    raise AssertionError(f"the run ended before printing {prefix!r}: {proc.stderr.read()[-2000:]}")


def said_errors(stderr):
    """The error lines that the ranks of a run said ("error: ..."), not torchrun's summary, which
    gives one of them again as its root cause (torchrun_root_cause)."""
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


# ----------------------------------------------------------------------------- ranks started in-test

# What the ranks are forked from: a server process that has imported torch and FSDP's modules (the
# slowest of the trainer's imports) and started no thread (fork copies only the forking thread, and
# a lock another thread held stays locked in the child); each rank imports the rest, as a script would.
RANKS_PRELOAD = ["torch", "torch.distributed.fsdp", "helpers.processes"]


@dataclass
class Ranks:
    """What the ranks of call_on_ranks did: ranks[i], rank i's CompletedProcess (exit code, stdout,
    stderr); and all ranks' together, as torchrun's output shows them."""
    ranks: list

    @property
    def returncode(self):
        """0 if every rank exited 0, else the first non-zero exit code in rank order (-N: killed by signal N)."""
        return next((rank.returncode for rank in self.ranks if rank.returncode), 0)

    @property
    def stdout(self):
        return "".join(rank.stdout for rank in self.ranks)

    @property
    def stderr(self):
        return "".join(rank.stderr for rank in self.ranks)


def call_on_ranks(fn, *args, nproc=2, timeout=300, preexec_fn=None):
    """fn(*args) on nproc ranks, each a process of its own, in the environment torchrun --standalone
    gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1,
    MASTER_PORT, TORCHELASTIC_*), the store they meet in held here as torchrun's agent holds it, so
    that the code takes its torchrun paths: distributed.init's gloo group, fail_alone's line in the
    store, env:// for a plain init_process_group. fn, args and preexec_fn (called first on each rank,
    as run_script's) must pickle: functions defined at a module's top level. Returns Ranks. Past
    timeout seconds every rank, and what it started, is killed and the test fails with their stderr.
    Not torchrun: no error file (TORCHELASTIC_ERROR_FILE) nor summary, no restarts, no signal
    forwarding, and no rank stopped because another failed (each must stop by itself); tests of
    those start torchrun, in tests/integration/. Nor an interpreter's exit: a rank ends with
    os._exit once its threads are joined, without atexit's handlers or the interpreter's teardown."""
    from torch.distributed import TCPStore

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(RANKS_PRELOAD)  # read when its server starts, once a process
    store = TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    output, reading, processes = {}, set(), []  # output: {read end: bytes read}, for each rank's stdout and stderr
    try:
        for rank in range(nproc):
            pipes = [os.pipe() for _ in ("stdout", "stderr")]
            output.update((read, []) for read, _ in pipes)
            reading.update(read for read, _ in pipes)
            ends = [Connection(write, readable=False) for _, write in pipes]  # sent to the rank as it starts
            process = context.Process(target=as_rank, args=(torchrun_env(rank, nproc, store.port), ends, preexec_fn,
                                                            fn, args))
            try:
                process.start()
            finally:
                for end in ends:
                    end.close()
            processes.append(process)
        running = read_pipes(output, reading, time.monotonic() + timeout, until=[p.sentinel for p in processes])
    finally:
        for process in processes:  # and what each started, whether or not the rank is gone
            kill_group(process.pid)
        read_pipes(output, reading, time.monotonic() + 10)  # what is left in them, now that nothing writes
        for fd in reading:
            os.close(fd)
        for process in processes:
            process.join()
        del store
    texts = [b"".join(chunks).decode() for chunks in output.values()]  # in the order of the ranks' pipes
    ranks = [subprocess.CompletedProcess((fn, *args), process.exitcode, *texts[2 * rank:2 * rank + 2])
             for rank, process in enumerate(processes)]
    if running:
        pytest.fail(f"the ranks ran past {timeout} s and were killed; their stderr:\n"
                    + "\n".join(f"rank {i}: {rank.stderr[-3000:]}" for i, rank in enumerate(ranks)))
    return Ranks(ranks)


def run_ranks(script, *args, nproc=2, timeout=300, preexec_fn=None):
    """The script (a path, or one of the repository's scripts) on nproc ranks, as `torchrun
    --standalone --nproc_per_node=nproc script args` runs it, the ranks started in-test (call_on_ranks)."""
    return call_on_ranks(run_as_main, os.path.join(REPO, script), [str(arg) for arg in args], nproc=nproc,
                         timeout=timeout, preexec_fn=preexec_fn)


def torchrun_env(rank, nproc, port):
    """The environment of rank: this process's, and what torchrun --standalone adds for its workers
    (but its error file) when its agent's store is at 127.0.0.1:port."""
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "in-test", "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}


def as_rank(env, ends, preexec_fn, fn, args):
    """One rank of call_on_ranks, in its process: in a process group of its own (so that a timeout
    kills what it starts too), in REPO, in env, its stdout and stderr the pipes' write ends, down to
    its file descriptors (what torch's C++ prints too); then fn(*args). multiprocessing makes an
    exception escaping fn a traceback and exit code 1, and SystemExit's code the exit code, as an
    interpreter does."""
    os.setsid()
    os.chdir(REPO)
    os.environ.clear()
    os.environ.update(env)
    for fd, end in zip((1, 2), ends):
        os.dup2(end.fileno(), fd)
        end.close()
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
    if preexec_fn is not None:
        preexec_fn()
    fn(*args)


def run_as_main(script, argv):
    """script, run as `python script argv` runs it."""
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


def read_pipes(output, reading, deadline, until=()):
    """Reads the pipes of reading (read ends, each removed and closed at its end) into output ({read
    end: [bytes]}) until every one of until (sentinels: processes' exits) is ready, or without them
    every pipe is at its end, or the deadline passes; returns those of until not ready. Read as they
    fill, so that no rank blocks on a full pipe."""
    waiting = set(until)
    while (waiting if until else reading) and time.monotonic() < deadline:
        for ready in multiprocessing.connection.wait([*reading, *waiting], max(0.0, deadline - time.monotonic())):
            if ready in waiting:
                waiting.discard(ready)
            elif chunk := os.read(ready, 1 << 16):
                output[ready].append(chunk)
            else:
                reading.remove(ready)
                os.close(ready)
    return waiting


def kill_group(pid):
    """SIGKILL to the process group of pid, which pid leads: pid, and what it started."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # gone, with everything it started
        pass
