"""PyTorch reference for tests/unit/nn/test_gpt_torch.cpp.

Reads a directory written by the test: manifest.json (config, parameter names
and shapes), one raw little-endian float64 file per parameter, tokens and
targets as raw int64. Builds the same GPT-2 forward pass from torch.nn.functional
in float64, runs cross-entropy and backward, and writes logits.bin,
grad.<name>.bin and result.json (the loss) into the same directory.
"""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F


def load(d, name, shape, dtype=torch.float64):
    with open(os.path.join(d, name), "rb") as f:
        data = f.read()
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape).clone()


def gpt_forward(p, ids, cfg):
    B, S = ids.shape
    C, H, L = cfg["n_embd"], cfg["n_head"], cfg["n_layer"]
    D = C // H
    x = p["embed.wte.weight"][ids] + p["embed.wpe.weight"][:S]
    mask = torch.tril(torch.ones(S, S, dtype=torch.bool))
    for l in range(L):
        q = f"h.{l}."
        h = F.layer_norm(x, (C,), p[q + "ln_1.weight"], p[q + "ln_1.bias"], 1e-5)
        qkv = F.linear(h, p[q + "attn.c_attn.weight"], p[q + "attn.c_attn.bias"])
        qq, kk, vv = qkv.split(C, dim=2)
        qq = qq.view(B, S, H, D).transpose(1, 2)
        kk = kk.view(B, S, H, D).transpose(1, 2)
        vv = vv.view(B, S, H, D).transpose(1, 2)
        att = (qq @ kk.transpose(-2, -1)) / math.sqrt(D)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ vv).transpose(1, 2).reshape(B, S, C)
        x = x + F.linear(y, p[q + "attn.c_proj.weight"], p[q + "attn.c_proj.bias"])
        h = F.layer_norm(x, (C,), p[q + "ln_2.weight"], p[q + "ln_2.bias"], 1e-5)
        h = F.gelu(F.linear(h, p[q + "mlp.c_fc.weight"], p[q + "mlp.c_fc.bias"]), approximate="tanh")
        x = x + F.linear(h, p[q + "mlp.c_proj.weight"], p[q + "mlp.c_proj.bias"])
    x = F.layer_norm(x, (C,), p["head.ln_f.weight"], p["head.ln_f.bias"], 1e-5)
    w = p["embed.wte.weight"] if cfg["tie_weights"] else p["head.lm_head.weight"]
    return F.linear(x, w)


def main():
    d = sys.argv[1]
    with open(os.path.join(d, "manifest.json")) as f:
        m = json.load(f)
    cfg = m["config"]
    params = {}
    for e in m["params"]:
        params[e["name"]] = load(d, e["file"], e["shape"]).requires_grad_(True)
    ids = load(d, "tokens.bin", m["tokens_shape"], torch.int64)
    targets = load(d, "targets.bin", [ids.numel()], torch.int64)
    logits = gpt_forward(params, ids, cfg)
    loss = F.cross_entropy(logits.reshape(-1, cfg["vocab_size"]), targets)
    loss.backward()
    logits.detach().numpy().astype("<f8").tofile(os.path.join(d, "logits.bin"))
    for e in m["params"]:
        params[e["name"]].grad.numpy().astype("<f8").tofile(os.path.join(d, "grad." + e["file"]))
    with open(os.path.join(d, "result.json"), "w") as f:
        json.dump({"loss": loss.item(), "torch": torch.__version__}, f)


if __name__ == "__main__":
    main()
