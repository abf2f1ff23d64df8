"""Which attention kernels run, compiled and eager, for each --attention setting (profiler kernel names)."""
import os, sys, collections
import torch
sys.path.insert(0, os.getcwd())
import train_gpt2
from model import GPT, GPTConfig
from torch.profiler import profile, ProfilerActivity

for compiled in (True, False):
    for attention in ("auto", "math", "cudnn"):
        torch.compiler.reset()
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=12, n_embd=768)).cuda()
        t = train_gpt2.build_trainable(model, "cuda", torch.bfloat16, 1, compile_mode="default" if compiled else None,
                                       attention=attention)
        x = torch.randint(0, 50257, (8, 1024), device="cuda")
        for _ in range(2):
            with t.forward_context():
                loss = t.model(x, x)[1]
            loss.backward()
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            with t.forward_context():
                loss = t.model(x, x)[1]
            loss.backward()
            torch.cuda.synchronize()
        names = collections.Counter(e.name[:70] for e in prof.events() if e.device_type.name == "CUDA"
                                    and any(k in e.name.lower() for k in ("flash", "fmha", "cudnn", "attention", "bmm", "softmax", "sdpa")))
        print(f"compiled={compiled} attention={attention} peak={torch.cuda.max_memory_allocated()/2**30:.2f}GiB", dict(names.most_common(4)))
