"""The tables of README.md, from the runs' logs, per model size: val loss at each evaluation, and
the first evaluated step at which a run is at or below the best AdamW run's final val loss.

    python bench/results/muon-cpu-2core/table.py
"""
import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def val_losses(path):
    with open(path) as f:
        return {r["step"]: r["val_loss"] for r in map(json.loads, f) if "val_loss" in r}


for size in ("demo", "6x192"):
    runs = {os.path.basename(p)[:-len(".jsonl")]: val_losses(p) for p in sorted(glob.glob(f"{HERE}/{size}/*.jsonl"))}
    steps = sorted(next(iter(runs.values())))[1:]
    best_name = min((name for name in runs if name.startswith("adamw")), key=lambda name: runs[name][steps[-1]])
    best = runs[best_name][steps[-1]]
    print(f"\n{size}: the best AdamW run is {best_name}, final val loss {best:.4f}\n")
    print("| run | " + " | ".join(f"step {s}" for s in steps) + f" | at or below {best:.4f} by step |")
    print("| --- |" + " --- |" * (len(steps) + 1))
    for name, losses in runs.items():
        reached = next((s for s in steps if losses[s] <= best), "-")
        print(f"| {name} | " + " | ".join(f"{losses[s]:.4f}" for s in steps) + f" | {reached} |")
