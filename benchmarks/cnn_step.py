"""PyTorch twin of benchmarks/cnn_step.cpp: the same CNN, batch, AdamW, one thread.

Runs the C++ binary (--binary, default build/benchmarks/cnn_step) and then the
PyTorch step in the same process run, and prints both JSON lines and their
ratio. Run with Debian's python3-torch (/usr/bin/python3).
"""
import argparse
import json
import subprocess

import torch
from torch_step import median_step_ms


def make_model(c1, c2):
    def block(cin, cout):
        return [torch.nn.Conv2d(cin, cout, 3, padding=1, bias=False), torch.nn.BatchNorm2d(cout), torch.nn.ReLU(),
                torch.nn.MaxPool2d(2)]
    return torch.nn.Sequential(torch.nn.Unflatten(1, (1, 28, 28)), *block(1, c1), *block(c1, c2),
                               torch.nn.Flatten(), torch.nn.Linear(c2 * 7 * 7, 10))


def cnn_flops(batch, c1, c2):
    """FLOPs of one step, counted as in cnn_step.cpp."""
    conv1 = 2.0 * batch * c1 * 9 * 28 * 28
    conv2 = 2.0 * batch * c2 * c1 * 9 * 14 * 14
    linear = 2.0 * batch * c2 * 7 * 7 * 10
    return 2 * conv1 + 3 * conv2 + 3 * linear


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--binary", default="build/benchmarks/cnn_step")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--c1", type=int, default=16)
    p.add_argument("--c2", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()

    ours = json.loads(subprocess.run([a.binary, "--batch", str(a.batch), "--c1", str(a.c1), "--c2", str(a.c2),
                                      "--steps", str(a.steps), "--warmup", str(a.warmup)],
                                     check=True, capture_output=True, text=True).stdout)
    print(json.dumps(ours))

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ms, loss = median_step_ms(make_model(a.c1, a.c2), a.batch, a.warmup, a.steps)
    flops = cnn_flops(a.batch, a.c1, a.c2)
    theirs = {"bench": "cnn_step", "impl": "pytorch", "torch": torch.__version__,
              "mkldnn": torch.backends.mkldnn.is_available(), "batch": a.batch, "channels": [a.c1, a.c2],
              "steps": a.steps, "step_ms_median": ms, "samples_per_s": 1000.0 * a.batch / ms,
              "gflop_per_step": flops / 1e9, "gflops": flops / (ms * 1e6), "final_loss": loss}
    print(json.dumps(theirs))
    print(json.dumps({"bench": "cnn_step", "ratio_pytorch_over_ptrain_ms": ms / ours["step_ms_median"]}))


if __name__ == "__main__":
    main()
