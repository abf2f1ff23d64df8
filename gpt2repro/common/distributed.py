"""The processes of a run: joining torchrun's process group (NCCL for GPUs, gloo for CPUs, so
data parallelism runs and is tested on a CPU) and leaving it, the gloo groups beside it, the
decisions every rank must take alike, and what a rank that fails alone tells the others."""
import gc
import importlib
import json
import os
import signal
import socket

import torch
import torch.distributed as dist

from gpt2repro.common.devices import pick_device


class RunError(Exception):
    """A bad argument or state that stops the run, on every rank, with one line and exit code 1."""


def init(device_arg):
    """(rank, local_rank, world_size, device): from torchrun's environment, or one process."""
    rank, local_rank, world_size = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))
    try:
        device = pick_device(device_arg, local_rank if "RANK" in os.environ else None)
    except ValueError as e:
        raise RunError(f"--device {device_arg}: {e}") from None
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        # Imported before the group exists: on first import this module binds the default group
        # as a default argument (DDP imports it, through torch._dynamo) and would hold it, and
        # gloo's worker threads, past leave().
        importlib.import_module("torch.distributed.nn")  # not `import torch...`: that would make torch local here
        on_cuda = device.startswith("cuda")  # NCCL for CUDA, bound to this process's GPU
        global _agent_store
        _agent_store = restart_safe_store(world_size)
        dist.init_process_group("nccl" if on_cuda else "gloo", store=_agent_store, rank=rank,
                                world_size=world_size, device_id=torch.device(device) if on_cuda else None)
    return rank, local_rank, world_size, device


def restart_safe_store(world_size):
    """The key-value store the ranks meet in. torchrun's agent keeps one store alive across
    --max-restarts, and workers of a new attempt could read the addresses their killed
    predecessors left there (connection refused, or a hang). Prefixing the keys with the
    attempt number keeps each attempt's keys its own. None: let init_process_group decide."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False)
    return dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


_agent_store = None  # restart_safe_store's, which outlives the ranks; None without torchrun's agent
_host_groups = {}


def host_group(purpose):
    """A gloo group of its own for purpose ("signals", "checkpoints"), or None in one process.
    On the host, beside the training's group: asking whether to stop never waits for the GPU's
    queue, and a checkpoint written in the background never interleaves its collectives with the
    training's. Made on first use, which every rank reaches at the same point."""
    if not dist.is_initialized():
        return None
    if purpose not in _host_groups:
        _host_groups[purpose] = dist.new_group(backend="gloo")
    return _host_groups[purpose]


def leave():
    """Destroys the groups once nothing holds them, so that gloo's worker threads are joined here
    rather than left running as the interpreter exits (where one can abort a finished run). The
    DDP wrapper holds the group and sits in a reference cycle: only the garbage collector frees it."""
    if dist.is_initialized():
        gc.collect()
        _host_groups.clear()
        dist.destroy_process_group()


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def every_rank(value):
    """[rank 0's value, rank 1's, ...]: what each rank found, for decisions all ranks must share."""
    if not dist.is_initialized():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def on_every_rank(fn, *args, errors=()):
    """fn(*args), where a RunError, or one of errors, raised on any rank is raised as a RunError on
    every rank (see agree)."""
    try:
        result, error = fn(*args), None
    except (RunError, *errors) as e:
        result, error = None, str(e)
    agree(error)
    return result


def any_rank(*conditions):
    """For each of conditions (booleans), whether it is true on any rank: one all-reduce, on the
    host (the "signals" group), so asking never waits for the GPU's queue."""
    found = torch.tensor([float(condition) for condition in conditions])
    if dist.is_initialized():
        dist.all_reduce(found, group=host_group("signals"))
    return [bool(value) for value in found.tolist()]


def agree(error):
    """Raises RunError on every rank if any rank found an error (a message; None for none):
    a refusal taken on one rank alone would leave the others waiting at the next collective."""
    errors = [e for e in every_rank(error) if e is not None]
    if errors:
        raise RunError(errors[0])


FAILED_ALONE = "failed_alone"  # the store's key for what a rank that failed alone said


def fail_alone(line):
    """line, an error that this rank met alone (a window of the data no other rank reads, an error
    of its own), as this rank says it: naming the rank under torchrun. Left in torchrun's store for
    the other ranks, whose next collective fails once this rank has left (peer_failure)."""
    if not dist.is_initialized():
        return line
    line = f"rank {dist.get_rank()}: {line}"
    if _agent_store is not None:
        try:
            _agent_store.set(FAILED_ALONE, json.dumps([line, socket.gethostname()]))
        except RuntimeError:  # the agent is gone: the others learn only that this rank left
            pass
    return line


def peer_failure():
    """What this rank says of another rank that failed alone and left (fail_alone), which is why a
    collective failed here: None where none did; else that rank's line on rank 0 where that rank ran
    on another host, whose output holds its line; else "" (the line is in this host's output)."""
    try:
        if _agent_store is None or not _agent_store.check([FAILED_ALONE]):
            return None
        line, host = json.loads(_agent_store.get(FAILED_ALONE))
    except RuntimeError:
        return None
    return line if dist.get_rank() == 0 and host != socket.gethostname() else ""


class Stopped(Exception):
    """Raised by a loop that takes a stop_requested (an evaluation's batches: the val loss,
    HellaSwag, the samples' tokens) where stop_requested() says to stop, which it asks before each
    batch; the loop's partial result is dropped. stop_requested is asked at the same points on every
    rank and answers alike on all of them (StopSignal.heard), so all ranks raise at the same batch
    and none is left waiting at a collective."""


def never_stop():
    """The stop_requested of a loop that nothing stops (see Stopped): no collective."""
    return False


class StopSignal:
    """SIGTERM and SIGINT (what SLURM, Kubernetes, spot instances and torchrun send) ask the run
    to checkpoint and exit, dropping the step in flight; a second SIGINT interrupts at once.
    It may be entered before the ranks meet: their group is made at the first ask (requested),
    which every rank reaches at the same point."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __enter__(self):
        self.received = None
        self.previous = [signal.signal(sig, self._handle) for sig in self.SIGNALS]
        return self

    def requested(self, *conditions):
        """[whether any rank has been asked to stop, then whether each of conditions is true on any
        rank]: one all-reduce (any_rank). Every rank calls it at the same points and gets the same
        answers: the signal reaches the ranks at different moments."""
        return any_rank(self.received is not None, *conditions)

    def heard(self):
        """Whether any rank has been asked to stop: requested() without flags, the stop_requested
        that an evaluation loop takes (Stopped)."""
        return self.requested()[0]

    def __exit__(self, *exc):
        for sig, handler in zip(self.SIGNALS, self.previous):
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
