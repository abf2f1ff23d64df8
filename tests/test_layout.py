"""The code's layout as its readers meet it: the scripts at the root, the library in gpt2repro/, and
the boundaries between its wings that keep a script's imports to what it uses."""
import glob
import os
import subprocess
import sys

import pytest

from helpers import REPO

# What a user runs; all else a script imports is in gpt2repro/.
SCRIPTS = {"train_gpt2.py", "model.py", "fineweb.py", "hellaswag.py", "sample.py", "export_hf.py", "plot_log.py",
           "bench.py", "checkpoint.py", "core_eval.py"}


def loaded_modules(module):
    """The project's modules that importing module loads, in a fresh interpreter."""
    code = (f"import sys, {module}; print(' '.join(sorted(k for k in sys.modules if k.startswith('gpt2repro.') "
            f"or k == 'model')))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


def test_the_root_holds_the_scripts_and_the_package_the_rest():
    at_root = {os.path.basename(p) for p in glob.glob(os.path.join(REPO, "*.py"))}
    assert at_root <= SCRIPTS and {"train_gpt2.py", "model.py", "fineweb.py", "hellaswag.py"} <= at_root


@pytest.mark.parametrize("script", ["hellaswag", "sample", "export_hf"])
def test_loading_a_model_for_a_script_loads_nothing_of_the_checkpointer_or_the_optimizers(script):
    """A checkpoint's weights are read with the checkpoint files (runs/model_weights.py), not through
    the Checkpointer and the optimizers' state checks that a resume needs."""
    loaded = loaded_modules(script)
    assert "gpt2repro.runs.loading" in loaded
    assert not loaded & {"gpt2repro.runs.checkpoint", "gpt2repro.runs.optimizer_state",
                         "gpt2repro.training.optimizers"}


def test_the_step_imports_nothing_of_the_command_line_or_the_trainers_config():
    loaded = loaded_modules("gpt2repro.training.step")
    assert not loaded & {"gpt2repro.common.cli", "gpt2repro.training.train_config", "gpt2repro.training.faults"}
