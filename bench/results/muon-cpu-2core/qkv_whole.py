"""train_gpt2.py with Muon orthogonalizing c_attn whole, as one (3C, C) matrix (what
torch.optim.Muon does with any 2-D parameter), where --optimizer muon takes its q, k and v apart:
the comparison in README.md. Run from the repository root:

    python bench/results/muon-cpu-2core/qkv_whole.py --optimizer muon [train_gpt2.py flags]
"""
import os
import runpy
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path[0] = REPO  # the trainer's modules, where the trainer would find them

import torch  # noqa: E402
import muon  # noqa: E402

muon.BlockMuon._init_group = torch.optim.Muon._init_group  # no row blocks: every matrix whole
sys.argv = [os.path.join(REPO, "train_gpt2.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
