"""PyTorch twin of benchmarks/train_step.cpp: same MLP, batch, AdamW, one thread.

Prints one JSON line with the same fields. Run with Debian's python3-torch
(/usr/bin/python3) and libopenblas0-pthread installed.
"""
import argparse
import json

import torch
from torch_step import median_step_ms


def make_model(a):
    dims = [784] + [a.hidden] * a.layers
    mods = []
    for i in range(a.layers):
        mods += [torch.nn.Linear(dims[i], dims[i + 1]), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(dims[-1], 10))


def mlp_flops(a):
    """FLOPs of one step, counted as in benchmarks/mlp_bench.hpp."""
    flops, w = 0.0, 784
    for l in range(a.layers + 1):
        out = a.hidden if l < a.layers else 10
        flops += 2.0 * a.batch * w * out * (2 if l == 0 else 3)
        w = out
    return flops


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ms, loss = median_step_ms(make_model(a), a.batch, a.warmup, a.steps)
    flops = mlp_flops(a)
    print(json.dumps({"bench": "train_step", "impl": "pytorch", "torch": torch.__version__,
                      "hidden": a.hidden, "layers": a.layers, "batch": a.batch, "ranks": 1, "steps": a.steps,
                      "step_ms_median": ms, "samples_per_s": 1000.0 * a.batch / ms,
                      "gflop_per_step": flops / 1e9, "gflops": flops / (ms * 1e6), "final_loss": loss}))


if __name__ == "__main__":
    main()
