"""PyTorch twin of benchmarks/gpt_step.cpp: the same GPT-2 model (nanoGPT's
layout, tanh GELU, tied LM head, manual causal attention as torch 1.13 has no
fused attention), cross-entropy, AdamW, one thread. Prints one JSON line with
the same fields. Run with Debian's python3-torch (/usr/bin/python3).
"""
import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


class Block(nn.Module):
    def __init__(self, c, h):
        super().__init__()
        self.h = h
        self.ln_1 = nn.LayerNorm(c)
        self.c_attn = nn.Linear(c, 3 * c)
        self.attn_proj = nn.Linear(c, c)
        self.ln_2 = nn.LayerNorm(c)
        self.c_fc = nn.Linear(c, 4 * c)
        self.mlp_proj = nn.Linear(4 * c, c)

    def attn(self, x, mask):
        B, S, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, S, self.h, C // self.h).transpose(1, 2)
        k = k.view(B, S, self.h, C // self.h).transpose(1, 2)
        v = v.view(B, S, self.h, C // self.h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // self.h))
        att = att.masked_fill(mask[:S, :S] == 0, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, S, C)
        return self.attn_proj(y)

    def forward(self, x, mask):
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, block, layers, heads, embd, recompute=False):
        super().__init__()
        self.recompute = recompute
        self.wte = nn.Embedding(vocab, embd)
        self.wpe = nn.Embedding(block, embd)
        self.h = nn.ModuleList([Block(embd, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(embd)
        self.register_buffer("mask", torch.tril(torch.ones(block, block)))

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.h:
            if self.recompute:  # activation checkpointing, as ptrain's --recompute
                x = torch.utils.checkpoint.checkpoint(b, x, self.mask, use_reentrant=False)
            else:
                x = b(x, self.mask)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied head


def loaded_blas():
    """The BLAS library this process mapped (Debian's torch calls libblas.so.3, an alternative)."""
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "blas" in line.lower() and "/" in line}
    return ",".join(sorted(os.path.realpath(p) for p in libs)) or "none"


def init_gpt2(model, layers):
    """nanoGPT's init: N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 L)), zero biases."""
    for n, q in model.named_parameters():
        if "ln_" in n:
            continue
        if n.endswith("bias"):
            torch.nn.init.zeros_(q)
        elif n.endswith("proj.weight"):
            torch.nn.init.normal_(q, 0.0, 0.02 / math.sqrt(2 * layers))
        else:
            torch.nn.init.normal_(q, 0.0, 0.02)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--embd", type=int, default=384)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--vocab", type=int, default=65)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--recompute", action="store_true", help="checkpoint each block (torch.utils.checkpoint)")
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    model = GPT(a.vocab, a.block, a.layers, a.heads, a.embd, a.recompute)
    with torch.no_grad():
        init_gpt2(model, a.layers)
    decay = [q for n, q in model.named_parameters() if q.dim() >= 2 and "wte" not in n and "wpe" not in n]
    no_decay = [q for n, q in model.named_parameters() if not (q.dim() >= 2 and "wte" not in n and "wpe" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4)
    x = torch.randint(0, a.vocab, (a.batch, a.block))
    y = torch.randint(0, a.vocab, (a.batch * a.block,))

    def step():
        opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x).view(-1, a.vocab), y)
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(a.warmup):
        step()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = step()
        times.append((time.perf_counter() - t0) * 1e3)

    C, L, S = a.embd, a.layers, a.block
    fpt = 6.0 * (L * 12 * C * C + C * a.vocab) + 12.0 * L * S * C
    ms = statistics.median(times)
    tokens = a.batch * a.block
    print(json.dumps({"bench": "gpt_step", "impl": "pytorch", "torch": torch.__version__,
                      "blas": loaded_blas(),
                      "layers": L, "heads": a.heads, "embd": C, "block": S, "vocab": a.vocab, "batch": a.batch,
                      "recompute": a.recompute, "steps": a.steps, "parameters": sum(q.numel() for q in model.parameters()),
                      "step_ms_median": ms, "step_ms_min": min(times), "tokens_per_s": 1000.0 * tokens / ms,
                      "mflop_per_token": fpt / 1e6, "gflops": fpt * tokens / (ms * 1e6), "final_loss": loss}))


if __name__ == "__main__":
    main()
