"""Independent reference for tests/unit/nn/models/test_llama_reference.cpp.

usage: llama_torch_reference.py DIR

Reads DIR/manifest.json (the config, parameter names and shapes, the shape of the
token ids), one raw little-endian float64 file per parameter, tokens.bin (int64)
and dlogits.bin (float64, the gradient fed to backward). Builds the Llama forward
pass from the published architecture (Llama 2/3 papers, Hugging Face's
modeling_llama), written here from torch primitives in float64:

  RMSNorm      x / sqrt(mean(x^2) + eps) * w
  rotary       rotate-half pairs (i, i + D/2), angles position * inv_freq, with
               inv_freq = theta^(-2i/D) and Llama 3's wavelength rescaling
               computed below from its formula
  attention    grouped queries: query head h reads key/value head h // (H / Hkv);
               causal, and with a document token a query sees only keys of its own
               document, whose positions restart at 0
  MLP          down(silu(gate(x)) * up(x))

and lets torch.autograd differentiate sum(logits * dlogits): the gradients come
from autograd's own derivatives of these primitives, independent of ptrain's
hand-written backward passes. Writes logits.bin and grad.<name>.bin (float64).
"""
import json
import math
import os
import sys

import torch


def load(d, name, shape, dtype=torch.float64):
    with open(os.path.join(d, name), "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=dtype).reshape(shape).clone()


def inv_freq(D, cfg):
    inv = [1.0 / cfg["rope_theta"] ** (2 * i / D) for i in range(D // 2)]
    sc = cfg.get("llama3")
    if sc:
        L, lo, hi, factor = sc["original_max_position_embeddings"], sc["low_freq_factor"], sc["high_freq_factor"], sc["factor"]
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < L / hi:
                out.append(f)
            elif wavelen > L / lo:
                out.append(f / factor)
            else:
                smooth = (L / wavelen - lo) / (hi - lo)
                out.append((1 - smooth) * f / factor + smooth * f)
        inv = out
    return torch.tensor(inv, dtype=torch.float64)


def rotate(x, pos, inv):  # x [B, S, H, D], pos [B, S]
    ang = pos[:, :, None, None].double() * inv  # [B, S, 1, D/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    h = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def lin(p, name, x):
    y = x @ p[name + ".weight"].T
    return y + p[name + ".bias"] if name + ".bias" in p else y


def forward(p, ids, cfg):
    B, S = ids.shape
    C, H, Hkv, eps = cfg["n_embd"], cfg["n_head"], cfg["n_kv_head"], cfg["rms_norm_eps"]
    D = C // H
    starts = torch.zeros(B, S, dtype=torch.int64)
    for b in range(B):
        s = 0
        for i in range(S):
            if cfg["document_token"] >= 0 and ids[b, i].item() == cfg["document_token"]:
                s = i
            starts[b, i] = s
    pos = torch.arange(S)[None, :] - starts
    j = torch.arange(S)
    allowed = (j[None, None, :] <= j[None, :, None]) & (j[None, None, :] >= starts[:, :, None])  # [B, Sq, Sk]
    inv = inv_freq(D, cfg)
    x = p["embed_tokens.weight"][ids]
    for l in range(cfg["n_layer"]):
        q = f"layers.{l}."
        h = rms(x, p[q + "input_layernorm.weight"], eps)
        qq = rotate(lin(p, q + "self_attn.q_proj", h).view(B, S, H, D), pos, inv).transpose(1, 2)
        kk = rotate(lin(p, q + "self_attn.k_proj", h).view(B, S, Hkv, D), pos, inv).transpose(1, 2)
        vv = lin(p, q + "self_attn.v_proj", h).view(B, S, Hkv, D).transpose(1, 2)
        group = torch.tensor([hh // (H // Hkv) for hh in range(H)])
        kk, vv = kk[:, group], vv[:, group]
        att = (qq @ kk.transpose(-2, -1)) / math.sqrt(D)
        att = att.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
        y = (att @ vv).transpose(1, 2).reshape(B, S, H * D)
        x = x + lin(p, q + "self_attn.o_proj", y)
        h = rms(x, p[q + "post_attention_layernorm.weight"], eps)
        g = lin(p, q + "mlp.gate_proj", h)
        x = x + lin(p, q + "mlp.down_proj", g * torch.sigmoid(g) * lin(p, q + "mlp.up_proj", h))
    x = rms(x, p["head.norm.weight"], eps)
    return x @ (p["embed_tokens.weight"] if cfg["tie_weights"] else p["head.lm_head.weight"]).T


def main():
    d = sys.argv[1]
    m = json.load(open(os.path.join(d, "manifest.json")))
    cfg = m["config"]
    params = {e["name"]: load(d, e["file"], e["shape"]).requires_grad_(True) for e in m["params"]}
    ids = load(d, "tokens.bin", m["tokens_shape"], torch.int64)
    logits = forward(params, ids, cfg)
    dlogits = load(d, "dlogits.bin", list(logits.shape))
    (logits * dlogits).sum().backward()
    logits.detach().numpy().astype("<f8").tofile(os.path.join(d, "logits.bin"))
    for e in m["params"]:
        params[e["name"]].grad.numpy().astype("<f8").tofile(os.path.join(d, "grad." + e["file"]))


if __name__ == "__main__":
    main()
