"""Reference for tests/unit/ckpt/test_gpt2_weights.cpp: a GPT-2 in Hugging Face's layout.

usage: gpt2_hf_reference.py OUT_DIR
       gpt2_hf_reference.py logits MODEL_DIR IDS_JSON OUT_BIN

Writes random weights as Hugging Face's GPT2LMHeadModel state dict stores them
(names with "transformer.", Conv1D weights [in, out], the attention-mask buffers,
lm_head.weight equal to wte) to OUT_DIR/hf.safetensors, the same without the
prefix, the buffers and lm_head to OUT_DIR/hf_plain.safetensors, token ids to
tokens.bin (int64) and the logits of GPT-2's forward pass, written here from
scratch in numpy float64 (x @ W + b for Conv1D, tanh GELU, eps 1e-5), for the
first S positions to logits.bin, plus meta.json with the sizes.

The logits mode reads a Hugging Face GPT-2 folder (config.json, model.safetensors, as
transformers' GPT2LMHeadModel.from_pretrained does) and writes the logits (float64) of
the token ids in IDS_JSON ({"ids": [[...], ...]}).
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import safetensors_io  # noqa: E402

V, P, L, H, C = 37, 12, 2, 2, 16  # vocabulary, positions, layers, heads, width
B, S = 2, 8                       # the test's model has block_size S < P and a larger vocabulary


def layer_norm(x, w, b):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-5) * w + b


def gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def read_f32(path):
    out = {}
    for name, (dtype, shape, raw) in safetensors_io.read(path).items():
        if dtype != "F32":
            raise SystemExit(f"{path}: {name} is {dtype}, expected F32")
        out[name] = np.frombuffer(raw, dtype="<f4").reshape(shape)
    return out


def write_f32(path, arrays):
    safetensors_io.write(path, {n: ("F32", a.shape, np.ascontiguousarray(a, dtype="<f4").tobytes())
                                for n, a in arrays.items()})


def forward(w, ids, L=L, H=H, head=None):
    B, S = ids.shape
    C = w["wte.weight"].shape[1]
    x = w["wte.weight"][ids] + w["wpe.weight"][:S]
    D = C // H
    mask = np.tril(np.ones((S, S), dtype=bool))
    for l in range(L):
        p = lambda n: w[f"h.{l}.{n}"]
        a = layer_norm(x, p("ln_1.weight"), p("ln_1.bias")) @ p("attn.c_attn.weight") + p("attn.c_attn.bias")
        q, k, v = (a[..., i * C:(i + 1) * C].reshape(B, S, H, D).transpose(0, 2, 1, 3) for i in range(3))
        att = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D)
        att = np.where(mask, att, -np.inf)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(B, S, C)
        x = x + y @ p("attn.c_proj.weight") + p("attn.c_proj.bias")
        m = gelu(layer_norm(x, p("ln_2.weight"), p("ln_2.bias")) @ p("mlp.c_fc.weight") + p("mlp.c_fc.bias"))
        x = x + m @ p("mlp.c_proj.weight") + p("mlp.c_proj.bias")
    return layer_norm(x, w["ln_f.weight"], w["ln_f.bias"]) @ (w["wte.weight"] if head is None else head).T


def logits_of_folder(model_dir, ids_json, out_bin):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    if cfg["model_type"] != "gpt2" or cfg["activation_function"] != "gelu_new" or cfg["layer_norm_epsilon"] != 1e-5:
        raise SystemExit(f"{model_dir}/config.json does not describe the GPT-2 this forward pass computes: {cfg}")
    raw = read_f32(os.path.join(model_dir, "model.safetensors"))
    w = {k[len("transformer."):]: v.astype(np.float64) for k, v in raw.items() if k.startswith("transformer.")}
    tied = cfg.get("tie_word_embeddings", True)
    if tied != ("lm_head.weight" not in raw):
        raise SystemExit(f"tie_word_embeddings {tied}, but lm_head.weight is {'' if tied else 'not '}in the file")
    if w["wte.weight"].shape != (cfg["vocab_size"], cfg["n_embd"]) or w["wpe.weight"].shape[0] != cfg["n_positions"]:
        raise SystemExit(f"wte {w['wte.weight'].shape}, wpe {w['wpe.weight'].shape} do not match {cfg}")
    if len(raw) != 2 + 12 * cfg["n_layer"] + 2 + (0 if tied else 1):
        raise SystemExit(f"{len(raw)} tensors for {cfg['n_layer']} layers")
    ids = np.array(json.load(open(ids_json))["ids"], dtype=np.int64)
    head = None if tied else raw["lm_head.weight"].astype(np.float64)
    forward(w, ids, cfg["n_layer"], cfg["n_head"], head).astype("<f8").tofile(out_bin)


def main():
    if sys.argv[1] == "logits":
        return logits_of_folder(*sys.argv[2:5])
    out = sys.argv[1]
    rng = np.random.default_rng(5)
    u = lambda *shape: rng.uniform(-0.4, 0.4, shape).astype(np.float32)
    w = {"wte.weight": u(V, C), "wpe.weight": u(P, C)}
    for l in range(L):
        w.update({f"h.{l}.ln_1.weight": 1 + u(C), f"h.{l}.ln_1.bias": u(C),
                  f"h.{l}.attn.c_attn.weight": u(C, 3 * C), f"h.{l}.attn.c_attn.bias": u(3 * C),
                  f"h.{l}.attn.c_proj.weight": u(C, C), f"h.{l}.attn.c_proj.bias": u(C),
                  f"h.{l}.ln_2.weight": 1 + u(C), f"h.{l}.ln_2.bias": u(C),
                  f"h.{l}.mlp.c_fc.weight": u(C, 4 * C), f"h.{l}.mlp.c_fc.bias": u(4 * C),
                  f"h.{l}.mlp.c_proj.weight": u(4 * C, C), f"h.{l}.mlp.c_proj.bias": u(C)})
    w.update({"ln_f.weight": 1 + u(C), "ln_f.bias": u(C)})
    full = {"transformer." + k: v for k, v in w.items()}
    for l in range(L):
        full[f"transformer.h.{l}.attn.bias"] = np.tril(np.ones((P, P), dtype=np.float32))[None, None]
    full["lm_head.weight"] = w["wte.weight"]
    write_f32(os.path.join(out, "hf.safetensors"), full)
    write_f32(os.path.join(out, "hf_plain.safetensors"), w)
    ids = rng.integers(0, V, (B, S))
    ids.astype("<i8").tofile(os.path.join(out, "tokens.bin"))
    forward({k: v.astype(np.float64) for k, v in w.items()}, ids).astype("<f8").tofile(os.path.join(out, "logits.bin"))
    json.dump({"vocab": V, "positions": P, "layers": L, "heads": H, "embd": C, "batch": B, "seq": S},
              open(os.path.join(out, "meta.json"), "w"))


if __name__ == "__main__":
    main()
