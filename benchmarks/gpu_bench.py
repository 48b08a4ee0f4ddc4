"""PyTorch twin of benchmarks/gpu_bench.cu on cuda:0: the same GEMM shapes, the
same memory-bound ops over the same sizes (bytes counted by the same formulas)
and the GPT training step, with the same JSON fields and "impl": "pytorch".
tools/gpu/run.sh runs both; tools/gpu/compare.py puts them side by side.

What a PyTorch user would run: torch.matmul (FP32, TF32, bf16), F.gelu(tanh),
layer_norm, torch.optim.AdamW(fused=True), softmax, cross_entropy, and the GPT
of benchmarks/gpt_step.py (no dropout, tied head, mean cross-entropy) with its
manual attention and with F.scaled_dot_product_attention (is_causal=True) in
FP32 + TF32, plus bf16 lines against ptrain's GPT<bf16>: eager, and PyTorch's best
recipe, torch.compile (mode "default") on the same autocast model.

The bf16 line is torch.autocast(bfloat16) with fp32 parameters, fp32 gradients
and fused AdamW on them: PyTorch's usual mixed precision and the closest to
ptrain's bf16 parameters with fp32 master weights (model.to(bfloat16) would
drop the fp32 master copy). Its eager SDPA is held to the flash kernel, the
counterpart of ptrain's fused attention; the compiled line lets SDPA choose, reads
the loss only after the timed steps and compiles forward and loss together
(backward through AOTAutograd; fused AdamW stays eager, as PyTorch advises). A section that fails prints a
"gpu_error" line and the others still run; the exit code is then 1.
"""
import argparse
import contextlib
import gc
import json
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt_step import Block, init_gpt2

DEV = torch.device("cuda", 0)


def set_tf32(on):
    """TF32 for float32 matmuls. PyTorch 2.9 replaced allow_tf32 by fp32_precision and
    refuses a mix of the two, so the older one is used only where the newer is missing."""
    m = torch.backends.cuda.matmul
    try:
        m.fp32_precision = "tf32" if on else "ieee"
    except (AttributeError, AssertionError):  # unknown attribute: before 2.9 (1.x asserts)
        m.allow_tf32 = on


def time_gpu(a, f):
    """Per-call GPU time of f(), as gpu_bench.cu measures it: one timed call sizes the
    repetitions so that a sample lasts about --sample-ms; median and min over --samples."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    f()
    start.record()
    f()
    stop.record()
    stop.synchronize()
    reps = int(min(10000, max(1, math.ceil(a.sample_ms / max(1e-3, start.elapsed_time(stop))))))
    per_call = []
    for _ in range(a.samples):
        start.record()
        for _ in range(reps):
            f()
        stop.record()
        stop.synchronize()
        per_call.append(start.elapsed_time(stop) / reps)
    return statistics.median(per_call), min(per_call), reps


def emit(j):
    print(json.dumps(j), flush=True)


def log(s):
    print(s, file=sys.stderr, flush=True)


def bench_gemm(a, gpu):
    M, C, V = a.batch * a.block, a.embd, a.vocab
    layers = [("attn_qkv", C, 3 * C), ("attn_proj", C, C), ("mlp_fc", C, 4 * C), ("mlp_proj", 4 * C, C),
              ("lm_head", C, V)]
    log(f"\nGEMM, M = {M} tokens\n{'layer':10} {'op':10} {'M':>6} {'N':>6} {'K':>6} {'prec':>5} "
        f"{'median_ms':>10} {'TFLOP/s':>9}")
    for name, k, n in layers:
        x = torch.empty(M, k, device=DEV).uniform_(-1, 1)
        w = torch.empty(n, k, device=DEV).uniform_(-1, 1)
        dy = torch.empty(M, n, device=DEV).uniform_(-1, 1)
        for prec in ("fp32", "tf32", "bf16"):
            set_tf32(prec == "tf32")
            # bf16: operands and results in bf16, fp32 accumulation, as ptrain's gemm_bf16.
            dt = torch.bfloat16 if prec == "bf16" else torch.float32
            xs, ws, dys = x.to(dt), w.to(dt), dy.to(dt)
            y, dx, dw = (torch.empty(M, n, device=DEV, dtype=dt), torch.empty(M, k, device=DEV, dtype=dt),
                         torch.empty(n, k, device=DEV, dtype=dt))
            # The three products of nn.Linear: Y = X W^T, dX = dY W, dW = dY^T X (transposed views, no copies).
            ops = [("fwd", False, True, M, n, k, lambda: torch.matmul(xs, ws.t(), out=y)),
                   ("bwd_data", False, False, M, k, n, lambda: torch.matmul(dys, ws, out=dx)),
                   ("bwd_weight", True, False, n, k, M, lambda: torch.matmul(dys.t(), xs, out=dw))]
            for op, ta, tb, m_, n_, k_, f in ops:
                ms, mn, reps = time_gpu(a, f)
                tflops = 2.0 * m_ * n_ * k_ / (ms * 1e-3) / 1e12
                emit({"bench": "gpu_gemm", "impl": "pytorch", "gpu": gpu, "torch": torch.__version__, "layer": name,
                      "op": op, "m": m_, "n": n_, "k": k_, "trans_a": ta, "trans_b": tb, "precision": prec,
                      "median_ms": ms, "min_ms": mn, "reps": reps, "samples": a.samples, "tflops": tflops})
                log(f"{name:10} {op:10} {m_:6} {n_:6} {k_:6} {prec:>5} {ms:10.3f} {tflops:9.1f}")
    set_tf32(False)


def bench_bandwidth(a, gpu):
    M, C, V = a.batch * a.block, a.embd, a.vocab
    n = M * 4 * C  # the MLP activation, larger than L2 (see gpu_bench.cu)
    ln_rows = n // C
    P = num_parameters(a)
    Fb = 4  # bytes per float
    copy_gbps = []
    log(f"\nMemory-bound kernels\n{'op':22} {'shape':18} {'MB moved':>10} {'median_ms':>10} {'GB/s':>9} {'vs copy':>8}")

    def report(op, shape, nbytes, f):
        ms, mn, reps = time_gpu(a, f)
        gbps = nbytes / (ms * 1e-3) / 1e9
        if not copy_gbps:
            copy_gbps.append(gbps)  # the copy runs first and is the reference
        emit({"bench": "gpu_bandwidth", "impl": "pytorch", "gpu": gpu, "torch": torch.__version__, "op": op,
              "shape": shape, "bytes": nbytes, "median_ms": ms, "min_ms": mn, "reps": reps, "samples": a.samples,
              "GBps": gbps, "frac_of_copy": gbps / copy_gbps[0]})
        log(f"{op:22} {'x'.join(map(str, shape)):18} {nbytes / 1e6:10.1f} {ms:10.3f} {gbps:9.1f} "
            f"{gbps / copy_gbps[0]:8.2f}")

    # Byte counts are the minimum each op must move, the formulas of gpu_bench.cu.
    x = torch.empty(n, device=DEV).uniform_(-3, 3)
    dy = torch.empty(n, device=DEV).uniform_(-1, 1)
    y = torch.empty(n, device=DEV)
    report("copy", [n], 2 * n * Fb, lambda: y.copy_(x))
    x2, dy2, y2 = x.view(M, 4 * C), dy.view(M, 4 * C), y.view(M, 4 * C)
    report("gelu_forward", [M, 4 * C], 2 * n * Fb, lambda: F.gelu(x2, approximate="tanh"))
    report("gelu_backward", [M, 4 * C], 3 * n * Fb,
           lambda: torch.ops.aten.gelu_backward(dy2, x2, approximate="tanh"))
    bias = torch.empty(4 * C, device=DEV).uniform_(-1, 1)
    report("bias_add", [M, 4 * C], (2 * n + 4 * C) * Fb, lambda: y2.add_(bias))
    gamma = torch.empty(C, device=DEV).uniform_(0.5, 1.5)
    beta = torch.empty(C, device=DEV).uniform_(-0.5, 0.5)
    xl = x.view(ln_rows, C)
    # native_layer_norm also returns mean and rstd, as ptrain's forward saves them for backward.
    report("layer_norm_forward", [ln_rows, C], (2 * n + 2 * ln_rows + 2 * C) * Fb,
           lambda: torch.ops.aten.native_layer_norm(xl, [C], gamma, beta, 1e-5))
    del x, dy, y, x2, dy2, y2, xl
    torch.cuda.empty_cache()

    p = nn.Parameter(torch.empty(P, device=DEV).uniform_(-1, 1))
    p.grad = torch.empty(P, device=DEV).uniform_(-1, 1)
    opt = torch.optim.AdamW([p], lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    opt.step()  # creates exp_avg and exp_avg_sq
    report("adamw_update", [P], 7 * P * Fb, opt.step)
    del p, opt
    torch.cuda.empty_cache()

    logits = torch.empty(M, V, device=DEV).uniform_(-4, 4)
    targets = torch.randint(0, V, (M,), device=DEV)
    report("softmax_rows", [M, V], 2 * M * V * Fb, lambda: torch.softmax(logits, dim=1))
    # PyTorch writes log_softmax [M, V] inside cross_entropy; the count stays ptrain's minimum,
    # so GB/s here is the effective rate for the same work. Unlike ptrain's, the loss stays on the GPU.
    ce_fwd = (M * V + 2 * M) * Fb
    report("cross_entropy_forward", [M, V], ce_fwd, lambda: F.cross_entropy(logits, targets))
    leaf = logits.detach().requires_grad_()
    report("cross_entropy_fwd_bwd", [M, V], ce_fwd + (2 * M * V + 2 * M) * Fb,
           lambda: torch.autograd.grad(F.cross_entropy(leaf, targets), leaf))
    del logits, leaf
    torch.cuda.empty_cache()


def num_parameters(a):
    """nn.GPTConfig::num_parameters: tied head, biases, two LayerNorms per block and ln_f."""
    C = a.embd
    block = 2 * 2 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C)
    return a.vocab * C + a.block * C + a.layers * block + 2 * C


class SdpaBlock(Block):
    """gpt_step.Block with F.scaled_dot_product_attention (fused causal kernels, no S x S matrix)."""

    def attn(self, x, mask):
        B, S, C = x.shape
        q, k, v = (t.view(B, S, self.h, C // self.h).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.attn_proj(y.transpose(1, 2).contiguous().view(B, S, C))


class GPT(nn.Module):
    """gpt_step.GPT (same layers, names and tied head) with positions made on the tokens'
    device and a choice of attention."""

    def __init__(self, vocab, block, layers, heads, embd, sdpa):
        super().__init__()
        self.wte = nn.Embedding(vocab, embd)
        self.wpe = nn.Embedding(block, embd)
        self.h = nn.ModuleList([(SdpaBlock if sdpa else Block)(embd, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(embd)
        self.register_buffer("mask", torch.tril(torch.ones(block, block)))

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.h:
            x = b(x, self.mask)
        return F.linear(self.ln_f(x), self.wte.weight)


def sdpa_flash():
    """Restricts F.scaled_dot_product_attention to its flash kernel (torch >= 2.3): the
    default choice may take cuDNN's or the memory-efficient kernel instead, and the bf16
    line is meant as flash against ptrain's fused attention. A case flash cannot serve
    fails (reported as a gpu_error line) instead of silently running another kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def step_times(a, step):
    """GPU time of each of --steps training steps after --warmup untimed ones (the peak memory
    counter reset after them): the times (ms), the warm-up's wall seconds (compilation
    included) and the last step's return value."""
    warm = time.perf_counter()
    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    warm = time.perf_counter() - warm
    torch.cuda.reset_peak_memory_stats()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times, out = [], None
    for _ in range(a.steps):
        start.record()
        out = step()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return times, warm, out


def bench_gpt(a, gpu, attention, precision, compiled=False):
    torch.manual_seed(0)
    set_tf32(not a.no_tf32)  # TF32 matmuls for the fp32 parts in every variant, as ptrain's step (--no-tf32)
    model = GPT(a.vocab, a.block, a.layers, a.heads, a.embd, attention == "sdpa").to(DEV)
    with torch.no_grad():
        init_gpt2(model, a.layers)
    decay = [q for n, q in model.named_parameters() if q.dim() >= 2 and "wte" not in n and "wpe" not in n]
    no_decay = [q for n, q in model.named_parameters() if not (q.dim() >= 2 and "wte" not in n and "wpe" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, fused=True)
    x = torch.randint(0, a.vocab, (a.batch, a.block), device=DEV)
    y = torch.randint(0, a.vocab, (a.batch * a.block,), device=DEV)
    bf16 = precision == "bf16-autocast"
    # The flash backward follows from the forward's choice, so the forward alone needs the restriction.
    pinned = bf16 and attention == "sdpa" and not compiled
    attn_ctx = sdpa_flash if pinned else contextlib.nullcontext
    label = "sdpa_flash" if pinned else attention

    def forward_loss(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16), attn_ctx():
            return F.cross_entropy(model(x).view(-1, a.vocab), y)

    loss_of = torch.compile(forward_loss) if compiled else forward_loss

    def step():
        opt.zero_grad(set_to_none=False)
        loss = loss_of(x, y)
        loss.backward()
        opt.step()
        return loss if compiled else loss.item()  # the eager lines read the loss every step, as ptrain did

    times, compile_s, loss = step_times(a, step)
    set_tf32(False)
    loss = float(loss)

    C, L, S = a.embd, a.layers, a.block
    fpt = 6.0 * (L * 12 * C * C + C * a.vocab) + 6.0 * L * 2 * S * C  # GPTConfig::flops_per_token
    ms = statistics.median(times)
    tokens = a.batch * S
    tflops = fpt * tokens / (ms * 1e-3) / 1e12
    peak = a.peak_tflops_bf16 if bf16 else a.peak_tflops
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    emit({"bench": "gpu_gpt_step", "impl": "pytorch", "gpu": gpu, "torch": torch.__version__, "attention": label,
          "precision": precision, "layers": L, "heads": a.heads, "embd": C, "block": S,
          "vocab": a.vocab, "batch": a.batch, "steps": a.steps, "warmup": a.warmup,
          "mixed_precision": ("autocast bf16: fp32 parameters, gradients and AdamW state; matmuls and attention "
                              "in bf16, LayerNorm and loss in fp32") if bf16 else "none",
          "adamw": "torch.optim.AdamW(fused=True), two param groups", "dropout": 0.0,
          "compile": "torch.compile(mode='default') of forward + loss" if compiled else "eager",
          "warmup_s": compile_s,
          "parameters": sum(q.numel() for q in model.parameters()), "step_ms_median": ms, "step_ms_min": min(times),
          "tokens_per_s": 1000.0 * tokens / ms, "mflop_per_token": fpt / 1e6, "tflops": tflops,
          "peak_tflops": peak,
          "peak_note": "defaults: 494.7 = H100/H200 SXM dense TF32, 989.4 = dense BF16; flags for other parts",
          "mfu": tflops / peak, "peak_mem_GiB": peak_gib, "final_loss": loss})
    log(f"\nGPT step ({L} layers, width {C}, {a.batch} x {S} tokens, {label}, {precision}"
        f"{', compiled' if compiled else ''}): {ms:.1f} ms median, "
        f"{1000.0 * tokens / ms:.0f} tokens/s, {tflops:.1f} TFLOP/s, MFU {tflops / peak:.3f} of {peak}, "
        f"peak memory {peak_gib:.1f} GiB, loss {loss:.4f}")
    del model, opt
    torch.cuda.empty_cache()


class LlamaBlock(nn.Module):
    """A Llama decoder layer as Hugging Face's LlamaDecoderLayer computes it: RMSNorm, q/k/v
    projections without bias, rotate-half rotary, key/value heads repeated for the query heads
    (repeat_kv), causal SDPA, o_proj; RMSNorm, SwiGLU (down(silu(gate(x)) * up(x)))."""

    def __init__(self, c, heads, kv_heads, mlp):
        super().__init__()
        self.h, self.kv, self.d = heads, kv_heads, c // heads
        self.input_layernorm = nn.RMSNorm(c, eps=1e-5)
        self.q_proj = nn.Linear(c, c, bias=False)
        self.k_proj = nn.Linear(c, kv_heads * self.d, bias=False)
        self.v_proj = nn.Linear(c, kv_heads * self.d, bias=False)
        self.o_proj = nn.Linear(c, c, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(c, eps=1e-5)
        self.gate_proj = nn.Linear(c, mlp, bias=False)
        self.up_proj = nn.Linear(c, mlp, bias=False)
        self.down_proj = nn.Linear(mlp, c, bias=False)

    def forward(self, x, cos, sin):
        B, S, C = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(B, S, self.h, self.d).transpose(1, 2)
        k = self.k_proj(h).view(B, S, self.kv, self.d).transpose(1, 2)
        v = self.v_proj(h).view(B, S, self.kv, self.d).transpose(1, 2)

        def rotate(t):
            t1, t2 = t.chunk(2, dim=-1)
            return t * cos + torch.cat((-t2, t1), dim=-1) * sin

        q, k = rotate(q), rotate(k)
        k, v = (t.repeat_interleave(self.h // self.kv, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(B, S, C))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    """gpu_bench.cu's Llama-shaped model: embeddings tied to the head, a final RMSNorm."""

    def __init__(self, a):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.llama_vocab, a.llama_embd)
        self.layers = nn.ModuleList([LlamaBlock(a.llama_embd, a.llama_heads, a.llama_kv_heads, a.llama_mlp)
                                     for _ in range(a.llama_layers)])
        self.norm = nn.RMSNorm(a.llama_embd, eps=1e-5)
        d = a.llama_embd // a.llama_heads
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        angles = torch.outer(torch.arange(a.llama_seq, dtype=torch.float64), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, idx):
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return F.linear(self.norm(x), self.embed_tokens.weight)


def llama_flops_per_token(a):
    """LlamaConfig::flops_per_token: 6 x the matrix products' parameters + the attention products."""
    C, L, S, H, F_ = a.llama_embd, a.llama_layers, a.llama_seq, a.llama_heads, a.llama_mlp
    D = C // H
    per_layer = C * H * D * 2 + 2 * C * a.llama_kv_heads * D + 3 * C * F_
    return 6.0 * (L * per_layer + C * a.llama_vocab) + 6.0 * L * 2.0 * S * H * D


def bench_llama(a, gpu, compiled):
    """The Llama-shaped step in bf16 autocast with fused AdamW: eager with SDPA (which picks its
    kernel), or torch.compile of forward + loss."""
    torch.manual_seed(0)
    model = Llama(a).to(DEV)
    with torch.no_grad():
        for n, q in model.named_parameters():
            if q.dim() >= 2:
                q.normal_(0.0, 0.02)
    decay = [q for n, q in model.named_parameters() if q.dim() >= 2 and "embed_tokens" not in n]
    no_decay = [q for n, q in model.named_parameters() if not (q.dim() >= 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, fused=True)
    x = torch.randint(0, a.llama_vocab, (a.llama_batch, a.llama_seq), device=DEV)
    y = torch.randint(0, a.llama_vocab, (a.llama_batch * a.llama_seq,), device=DEV)

    def forward_loss(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return F.cross_entropy(model(x).view(-1, a.llama_vocab), y)

    loss_of = torch.compile(forward_loss) if compiled else forward_loss

    def step():
        opt.zero_grad(set_to_none=False)
        loss = loss_of(x, y)
        loss.backward()
        opt.step()
        return loss

    times, warm, loss = step_times(a, step)
    ms, tokens, fpt = statistics.median(times), a.llama_batch * a.llama_seq, llama_flops_per_token(a)
    tflops = fpt * tokens / (ms * 1e-3) / 1e12
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    emit({"bench": "gpu_llama_step", "impl": "pytorch", "gpu": gpu, "torch": torch.__version__,
          "precision": "bf16-autocast", "compile": "torch.compile(mode='default') of forward + loss" if compiled
          else "eager", "layers": a.llama_layers, "heads": a.llama_heads, "kv_heads": a.llama_kv_heads,
          "embd": a.llama_embd, "mlp": a.llama_mlp, "seq": a.llama_seq, "vocab": a.llama_vocab,
          "batch": a.llama_batch, "steps": a.steps, "warmup": a.warmup, "warmup_s": warm,
          "parameters": sum(q.numel() for q in model.parameters()), "step_ms_median": ms, "step_ms_min": min(times),
          "tokens_per_s": 1000.0 * tokens / ms, "mflop_per_token": fpt / 1e6, "tflops": tflops,
          "peak_tflops": a.peak_tflops_bf16, "mfu": tflops / a.peak_tflops_bf16, "peak_mem_GiB": peak_gib,
          "final_loss": float(loss)})
    log(f"\nLlama step ({a.llama_layers} layers, width {a.llama_embd}, {a.llama_heads}/{a.llama_kv_heads} heads, "
        f"{a.llama_batch} x {a.llama_seq} tokens, bf16 autocast{', compiled' if compiled else ''}): {ms:.1f} ms "
        f"median, {1000.0 * tokens / ms:.0f} tokens/s, {tflops:.1f} TFLOP/s, MFU {tflops / a.peak_tflops_bf16:.3f}, "
        f"peak memory {peak_gib:.1f} GiB, loss {float(loss):.4f}")
    del model, opt
    torch.cuda.empty_cache()


def bench_attention(a, gpu):
    """gpu_bench.cu's attention section: causal SDPA in bf16 on the layout a GPT hands it
    (q, k, v strided views of one [B, S, 3, H, D] tensor), pinned to each of the flash
    and cuDNN backends in turn; forward, and forward + backward of the three inputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for D in (64, 128):
        for S in (1024, 4096, 8192):
            B, H = 16384 // S, 2048 // D
            qkv = (torch.rand(B, S, 3, H, D, device=DEV) * 2 - 1).to(torch.bfloat16).requires_grad_()
            dy = (torch.rand(B, H, S, D, device=DEV) * 2 - 1).to(torch.bfloat16)
            q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
            fwd_flops = 2.0 * B * H * S * S * D
            for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    with sdpa_kernel(backend):
                        def forward():
                            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

                        def forward_backward():
                            return torch.autograd.grad(forward(), qkv, dy)

                        for pass_, flops, f in (("fwd", fwd_flops, forward),
                                                ("fwd_bwd", 3.5 * fwd_flops, forward_backward)):
                            ms, mn, reps = time_gpu(a, f)
                            emit({"bench": "gpu_attention", "impl": "pytorch", "gpu": gpu, "backend": name,
                                  "pass": pass_, "batch": B, "seq": S, "heads": H, "head_dim": D, "causal": True,
                                  "median_ms": ms, "min_ms": mn, "tflops": flops / (ms * 1e-3) / 1e12})
                            log(f"attention {name:10} {pass_:8} B {B:2} S {S:5} H {H:2} D {D:3} {ms:9.3f} ms "
                                f"{flops / (ms * 1e-3) / 1e12:7.1f} TFLOP/s")
                except Exception as e:  # noqa: BLE001 -- a backend that cannot serve a case (cuDNN missing)
                    emit({"bench": "gpu_error", "impl": "pytorch", "gpu": gpu, "section": f"attention_{name}",
                          "error": f"S {S} D {D}: {type(e).__name__}: {e}"})
            del qkv, dy, q, k, v
            torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=["gemm", "bandwidth", "gpt", "llama", "attention", "moe"],
                   default=["gemm", "bandwidth", "gpt", "llama", "attention"])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--embd", type=int, default=768)
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--llama-layers", type=int, default=16, help="blocks of the Llama-shaped step")
    p.add_argument("--llama-batch", type=int, default=4, help="sequences per Llama step")
    p.add_argument("--samples", type=int, default=7)
    p.add_argument("--sample-ms", type=float, default=20.0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--attention", choices=["manual", "sdpa", "both"], default="both",
                   help="GPT attention: gpt_step.py's manual one, F.scaled_dot_product_attention, or both")
    p.add_argument("--no-float", action="store_true", help="skip the TF32/FP32 GPT lines (as gpu_bench --no-float)")
    p.add_argument("--no-bf16", action="store_true", help="skip the bf16 autocast GPT lines")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile bf16 GPT line")
    p.add_argument("--no-tf32", action="store_true", help="FP32 instead of TF32 matmuls in the GPT step, as gpu_bench")
    p.add_argument("--peak-tflops", type=float, default=494.7, help="MFU peak for fp32/TF32 (H100/H200 SXM dense TF32)")
    p.add_argument("--peak-tflops-bf16", type=float, default=989.4, help="MFU peak for bf16 (H100/H200 SXM dense)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        log("gpu_bench.py: no CUDA device visible")
        raise SystemExit(77)
    gpu = torch.cuda.get_device_name(0)
    log(f"gpu_bench.py on {gpu}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    failed = []

    def section(name, f, *args):
        """Runs one section; a failure (out of memory, no flash kernel, ...) reports and the run goes on."""
        try:
            f(*args)
        except Exception as e:  # noqa: BLE001 -- any failure of one section must leave the others running
            failed.append(name)
            msg = f"{type(e).__name__}: {e}"
            log(f"\ngpu_bench.py: section {name} failed: {msg}")
            emit({"bench": "gpu_error", "impl": "pytorch", "gpu": gpu, "section": name, "error": msg})
        # The failed section's tensors are freed with its frames; hand the cache back for the next one.
        gc.collect()
        try:
            set_tf32(False)
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 -- a sticky CUDA error: later sections report it themselves
            log(f"gpu_bench.py: cleanup after {name}: {e}")

    if "gemm" in a.only:
        section("gemm", bench_gemm, a, gpu)
    if "bandwidth" in a.only:
        section("bandwidth", bench_bandwidth, a, gpu)
    if "gpt" in a.only:
        fp = "fp32" if a.no_tf32 else "tf32"
        for attention in (["manual", "sdpa"] if a.attention == "both" else [a.attention]) if not a.no_float else []:
            section(f"gpt_{fp}_{attention}", bench_gpt, a, gpu, attention, fp)
        if not a.no_bf16:
            attention = "sdpa" if a.attention != "manual" else "manual"
            section(f"gpt_bf16_{attention}", bench_gpt, a, gpu, attention, "bf16-autocast")
            if not a.no_compile:
                section(f"gpt_bf16_{attention}_compiled", bench_gpt, a, gpu, attention, "bf16-autocast", True)
    if "llama" in a.only:
        # Llama 3.2 1B's shape, as gpu_bench.cu's Options::llama.
        a.llama_embd, a.llama_heads, a.llama_kv_heads, a.llama_mlp = 2048, 32, 8, 8192
        a.llama_vocab, a.llama_seq = 128256, 2048
        section("llama_bf16", bench_llama, a, gpu, False)
        if not a.no_compile:
            section("llama_bf16_compiled", bench_llama, a, gpu, True)
    if "attention" in a.only:
        section("attention", bench_attention, a, gpu)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
