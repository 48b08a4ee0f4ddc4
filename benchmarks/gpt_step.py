"""PyTorch twin of benchmarks/gpt_step.cpp: the same GPT-2 model (nanoGPT's
layout, tanh GELU, tied LM head, manual causal attention as torch 1.13 has no
fused attention), or with --model llama the same Llama (Hugging Face's
LlamaForCausalLM layout: RMSNorm, rotate-half rotary positions, grouped-query
attention through repeat_kv, SwiGLU, untied head), cross-entropy, AdamW, one
thread. Prints one JSON line with the same fields. Run with Debian's
python3-torch (/usr/bin/python3).
"""
import argparse
import json
import math
import os
import resource
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


class RMSNorm(nn.Module):
    def __init__(self, c, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, c, h, kv, ffn):
        super().__init__()
        self.h, self.kv, self.d = h, kv, c // h
        self.input_layernorm = RMSNorm(c)
        self.q_proj = nn.Linear(c, h * self.d, bias=False)
        self.k_proj = nn.Linear(c, kv * self.d, bias=False)
        self.v_proj = nn.Linear(c, kv * self.d, bias=False)
        self.o_proj = nn.Linear(h * self.d, c, bias=False)
        self.post_attention_layernorm = RMSNorm(c)
        self.gate_proj = nn.Linear(c, ffn, bias=False)
        self.up_proj = nn.Linear(c, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, c, bias=False)

    def attn(self, x, mask, cos, sin):
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.kv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.kv, self.d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(self.h // self.kv, dim=1)  # repeat_kv
        v = v.repeat_interleave(self.h // self.kv, dim=1)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.d))
        att = att.masked_fill(mask[:S, :S] == 0, float("-inf")).softmax(dim=-1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(B, S, self.h * self.d))

    def forward(self, x, mask, cos, sin):
        x = x + self.attn(self.input_layernorm(x), mask, cos, sin)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, vocab, block, layers, heads, kv_heads, embd, ffn, recompute=False, theta=10000.0):
        super().__init__()
        self.recompute = recompute
        self.embed_tokens = nn.Embedding(vocab, embd)
        self.layers = nn.ModuleList([LlamaBlock(embd, heads, kv_heads, ffn) for _ in range(layers)])
        self.norm = RMSNorm(embd)
        self.lm_head = nn.Linear(embd, vocab, bias=False)
        d = embd // heads
        inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        angles = torch.outer(torch.arange(block, dtype=torch.float32), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())
        self.register_buffer("mask", torch.tril(torch.ones(block, block)))

    def forward(self, idx):
        S = idx.shape[1]
        x = self.embed_tokens(idx)
        cos, sin = self.cos[:S], self.sin[:S]
        for b in self.layers:
            if self.recompute:
                x = torch.utils.checkpoint.checkpoint(b, x, self.mask, cos, sin, use_reentrant=False)
            else:
                x = b(x, self.mask, cos, sin)
        return self.lm_head(self.norm(x))


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
    p.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1024)
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

    llama = a.model == "llama"
    if llama:
        model = Llama(a.vocab, a.block, a.layers, a.heads, a.kv_heads, a.embd, a.intermediate, a.recompute)
        with torch.no_grad():
            for n, q in model.named_parameters():
                if "norm" not in n:
                    torch.nn.init.normal_(q, 0.0, 0.02)
    else:
        model = GPT(a.vocab, a.block, a.layers, a.heads, a.embd, a.recompute)
        with torch.no_grad():
            init_gpt2(model, a.layers)
    embeddings = ("wte", "wpe", "embed_tokens")
    decay = [q for n, q in model.named_parameters() if q.dim() >= 2 and not any(e in n for e in embeddings)]
    no_decay = [q for n, q in model.named_parameters() if not (q.dim() >= 2 and not any(e in n for e in embeddings))]
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
    if llama:  # LlamaConfig::flops_per_token
        kv = a.kv_heads * (C // a.heads)
        fpt = 6.0 * (L * (2 * C * C + 2 * C * kv + 3 * C * a.intermediate) + C * a.vocab) + 12.0 * L * S * C
    else:
        fpt = 6.0 * (L * 12 * C * C + C * a.vocab) + 12.0 * L * S * C
    ms = statistics.median(times)
    tokens = a.batch * a.block
    extra = {"kv_heads": a.kv_heads, "intermediate": a.intermediate} if llama else {}
    print(json.dumps({"bench": "llama_step" if llama else "gpt_step", "impl": "pytorch", "torch": torch.__version__,
                      "blas": loaded_blas(), **extra,
                      "layers": L, "heads": a.heads, "embd": C, "block": S, "vocab": a.vocab, "batch": a.batch,
                      "recompute": a.recompute, "steps": a.steps, "parameters": sum(q.numel() for q in model.parameters()),
                      "step_ms_median": ms, "step_ms_min": min(times), "tokens_per_s": 1000.0 * tokens / ms,
                      "mflop_per_token": fpt / 1e6, "gflops": fpt * tokens / (ms * 1e6),
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, "final_loss": loss}))


if __name__ == "__main__":
    main()
