"""Triton for the fused loss's tests: whether it is installed, and whether its interpreter can run
the kernel here."""
import functools
import importlib.util
import os

import pytest
import torch

TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not TRITON, reason="triton is not installed (pip install triton)")


# A test that runs loss.py's Triton kernel in Triton's interpreter, on CPU tensors: skipped, with
# interpreter_problem's reason, where the interpreter cannot run it (conftest.py).
interpreted = pytest.mark.interpreted


@functools.cache
def interpreter_problem():
    """Why Triton's interpreter cannot run loss.py's kernel here, in a line, or None where it can.
    The kernel loops over a count its caller passes (its columns), which Triton 3.6's interpreter
    cannot do with numpy 2.4: a tiny kernel that does so is run to find out."""
    if not TRITON:
        return "triton is not installed (pip install triton)"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton's interpreter is off: conftest.py sets it only where there is no GPU"
    import numpy
    import triton
    import triton.language as tl

    @triton.jit
    def count_to(out_ptr, n):
        total = 0
        for _ in range(0, n, 1):
            total += 1
        tl.store(out_ptr, total)

    try:
        count_to[(1,)](torch.zeros(1, dtype=torch.int32), 3)
    except Exception as e:  # the interpreter's failure: loss.py's kernel is not involved
        return (f"Triton {triton.__version__}'s interpreter fails on a loop over a kernel's argument (numpy "
                f"{numpy.__version__}): {e}")
    return None
