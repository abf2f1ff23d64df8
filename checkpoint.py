"""A sharded checkpoint as the one-file kind, in one process: hellaswag.py, sample.py and
export_hf.py read either, and a run resumes from either.

    python checkpoint.py log/ckpt_019073 log/ckpt_019073.pt
"""
if __name__ == "__main__":  # first: a Ctrl-C during the imports below, seconds long, is one line, not a traceback
    from gpt2repro.common.cli import exit_on_ctrl_c
    exit_on_ctrl_c()

import os
import sys

from gpt2repro.common.cli import Parser
from gpt2repro.runs.checkpoint import OptimizerPart, recorded_flag, recorded_flags, saved_optimizer_name
from gpt2repro.runs.checkpoint_files import TRAIN_STATE, ShardedCheckpoint, checkpoint_format, load_parts, save_checkpoint
from gpt2repro.runs.dcp_reader import CheckpointError
from gpt2repro.runs.model_weights import ModelPart, model_of
from gpt2repro.runs.optimizer_state import is_rate
from gpt2repro.training.optimizers import OptimizerConfig, build_optimizer


def main(argv=None):
    """python checkpoint.py SHARDED_DIR OUT.pt: a sharded checkpoint as the one-file kind, in one
    process: hellaswag.py, sample.py, export_hf.py read either, and a run resumes from either."""
    parser = Parser(prog="checkpoint.py", description=main.__doc__)
    parser.add_argument("sharded", help="a ckpt_XXXXXX/ directory that train_gpt2.py --fsdp 1 wrote")
    parser.add_argument("out", help="the .pt file to write")
    parser.add_argument("--force", action="store_true", help="replace out if it exists")
    args = parser.parse_args(argv)
    if checkpoint_format(args.sharded) is not ShardedCheckpoint:
        parser.fail(f"{args.sharded}: not a sharded checkpoint (no {TRAIN_STATE})")
    parser.check_output("out", args.out)
    if os.path.lexists(args.out) and not args.force:
        parser.refuse_to_replace(args.out, "exists")
    try:
        checkpoint = ShardedCheckpoint.load(args.sharded)
        state = checkpoint.state
        model = model_of(args.sharded, state["config"])
        # The groups' values come from the checkpoint, but for Muon's lr_scale: the run's own.
        lr, muon_lr = (recorded_flag(args.sharded, state, name, 1.0, is_rate) for name in ("max_lr", "muon_lr"))
        optimizer = build_optimizer(model, OptimizerConfig(saved_optimizer_name(args.sharded, state), lr, 0.0,
                                                           fused_adamw=False, muon_lr=muon_lr), "cpu")
        parts = {"model": ModelPart(model), "optimizer": OptimizerPart(model, optimizer)}
        load_parts(checkpoint, parts)
    except CheckpointError as e:
        parser.fail(str(e))
    state.update({name: part.state_dict() for name, part in parts.items()})
    if "args" in state:  # a record from before it was named "flags", or an older one beside them
        state["flags"] = recorded_flags(state)
        del state["args"]
    if not save_checkpoint(args.out, state):
        sys.exit(1)
    print(f"wrote {args.out}: step {state['step']}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
