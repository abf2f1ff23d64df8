"""What the tests share beside pytest's fixtures (conftest.py), a module for each kind of help:
kernels (Triton), models, files (users' inputs), processes (running the scripts, on ranks too),
limits (a full disk, a memory cap) and runs (the tiny training run). Everything runs offline."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
