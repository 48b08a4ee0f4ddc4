"""PyTorch twin of benchmarks/ddp_step.cpp: DistributedDataParallel over gloo,
the same MLP, per-rank batch and AdamW, one thread per rank.

Starts its own ranks (torch.multiprocessing) and prints one JSON line from
rank 0. Run with Debian's python3-torch (/usr/bin/python3).
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from train_step import make_model, mlp_flops


def run(rank, a, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=a.ranks)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(make_model(a))
    opt = torch.optim.AdamW(model.parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.rand(a.batch, 784, generator=g)
    y = torch.randint(0, 10, (a.batch,), generator=g)

    def step():
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    dist.barrier()
    for _ in range(a.warmup):
        step()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = step()
        times.append((time.perf_counter() - t0) * 1e3)
    ms = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    if rank == 0:
        ms = ms.item()
        flops = mlp_flops(a) * a.ranks
        print(json.dumps({"bench": "ddp_step", "impl": "pytorch", "torch": torch.__version__, "backend": "gloo",
                          "hidden": a.hidden, "layers": a.layers, "batch": a.batch, "ranks": a.ranks,
                          "steps": a.steps, "step_ms_median": ms,
                          "samples_per_s": 1000.0 * a.batch * a.ranks / ms, "gflop_per_step": flops / 1e9,
                          "gflops": flops / (ms * 1e6), "final_loss": loss}), flush=True)
    # torch 1.13's gloo teardown now and then spins forever in one rank after the result
    # is out (seen in about one run in ten on a 2-core VM): both ranks leave without it.
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--port", type=int, default=0, help="rendezvous port (0: a free one)")
    a = p.parse_args()
    port = a.port
    if port == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    mp.spawn(run, args=(a, port), nprocs=a.ranks)


if __name__ == "__main__":
    main()
