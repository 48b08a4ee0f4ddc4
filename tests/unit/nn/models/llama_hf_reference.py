"""Reference for tests/unit/nn/models/test_llama_weights.cpp: Hugging Face Llama folders.

usage: llama_hf_reference.py write OUT_DIR
       llama_hf_reference.py transformers MODEL_DIR IDS_JSON OUT_BIN
       llama_hf_reference.py mixtral MODEL_DIR IDS_JSON OUT_DIR

write: random weights in Hugging Face's LlamaForCausalLM layout ("model." names,
"lm_head.weight", [out, in] linear weights; this script's own table of names, not
ptrain's), written with plain struct + json (tests/safetensors_io.py) as
  OUT_DIR/f32/   config.json + model.safetensors, F32, untied, with the
                 rotary_emb.inv_freq buffers older transformers saved
  OUT_DIR/bf16/  config.json + model-0000k-of-00003.safetensors + index, BF16
                 (rounded to nearest even here), untied
  OUT_DIR/f16/   config.json + model.safetensors, F16, tied (no lm_head.weight)
and, for each, expected/<ptrain name>.bin: the values as float64, exactly what a
loader must produce.

transformers: logits (float64 file of float32 values) of
transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR) in float32 on the token
ids of IDS_JSON ({"ids": [[...], ...]}); the caller puts transformers on PYTHONPATH.

mixtral: MixtralForCausalLM.from_pretrained(MODEL_DIR) in float64 on the ids of
IDS_JSON, with labels = the ids (transformers' shifted mean cross entropy) and
output_router_logits=True: OUT_DIR/logits.bin, OUT_DIR/grad/<Hugging Face name>.bin
(float64, the gradients of out.loss, which adds router_aux_loss_coef * aux_loss) and
OUT_DIR/result.json: class, loss, aux_loss, coef and grad_aux_diff, the largest
difference between those gradients and the ones with output_router_logits=False
(transformers 4.36.2's load_balancing_loss_func is a constant, so 0), and switch: the
Switch / GShard load-balancing loss of each layer computed here from the router
logits; OUT_DIR/grad_switch/<name>.bin: the gradients of the cross entropy plus
router_aux_loss_coef times the sum of those per-layer losses.
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import safetensors_io  # noqa: E402

V, L, C, H, HKV, F = 29, 2, 16, 4, 2, 24  # vocabulary, layers, width, heads, kv heads, MLP width
D = C // H


def hf_tensors(rng, tied):
    u = lambda *shape: rng.uniform(-0.5, 0.5, shape)
    w = {"model.embed_tokens.weight": u(V, C)}
    for l in range(L):
        p = f"model.layers.{l}."
        w.update({p + "input_layernorm.weight": 1 + u(C),
                  p + "self_attn.q_proj.weight": u(H * D, C), p + "self_attn.k_proj.weight": u(HKV * D, C),
                  p + "self_attn.v_proj.weight": u(HKV * D, C), p + "self_attn.o_proj.weight": u(C, H * D),
                  p + "post_attention_layernorm.weight": 1 + u(C),
                  p + "mlp.gate_proj.weight": u(F, C), p + "mlp.up_proj.weight": u(F, C),
                  p + "mlp.down_proj.weight": u(C, F)})
    w["model.norm.weight"] = 1 + u(C)
    if not tied:
        w["lm_head.weight"] = u(V, C)
    return w


def ptrain_name(hf):
    if hf == "model.norm.weight":
        return "head.norm.weight"
    if hf == "lm_head.weight":
        return "head.lm_head.weight"
    assert hf.startswith("model.")
    return hf[len("model."):]


def encode(a, dtype):
    """(stored bytes, the exact float64 values they hold)"""
    if dtype == "F32":
        s = a.astype("<f4")
        return s.tobytes(), s.astype(np.float64)
    if dtype == "F16":
        s = a.astype("<f2")
        return s.tobytes(), s.astype(np.float64)
    bits = a.astype("<f4").view("<u4").astype(np.uint64)
    top = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")  # round to nearest even
    return top.tobytes(), (top.astype(np.uint32) << 16).view("<f4").astype(np.float64)


def config(tied):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": C,
            "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": HKV,
            "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
            "tie_word_embeddings": tied, "torch_dtype": "float32"}


def write_folder(out, rng, dtype, tied, shards=1, buffers=False):
    os.makedirs(os.path.join(out, "expected"), exist_ok=True)
    w = hf_tensors(rng, tied)
    stored = {}
    for name, a in w.items():
        raw, exact = encode(a, dtype)
        stored[name] = (dtype, a.shape, raw)
        exact.astype("<f8").tofile(os.path.join(out, "expected", ptrain_name(name) + ".bin"))
    if buffers:
        for l in range(L):
            inv = (1.0 / 10000.0 ** (np.arange(0, D, 2) / D)).astype("<f4")
            stored[f"model.layers.{l}.self_attn.rotary_emb.inv_freq"] = ("F32", inv.shape, inv.tobytes())
    json.dump(config(tied), open(os.path.join(out, "config.json"), "w"), indent=2)
    names = list(stored)
    if shards == 1:
        safetensors_io.write(os.path.join(out, "model.safetensors"), stored)
        return
    weight_map, total = {}, 0
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: stored[n] for n in names[k::shards]}
        safetensors_io.write(os.path.join(out, file), part)
        for n, (_, _, raw) in part.items():
            weight_map[n] = file
            total += len(raw)
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map},
              open(os.path.join(out, "model.safetensors.index.json"), "w"), indent=2)


def transformers_logits(model_dir, ids_json, out_bin):
    os.environ["HF_HUB_OFFLINE"] = "1"  # a local folder: never ask the network
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()
    ids = torch.tensor(json.load(open(ids_json))["ids"], dtype=torch.int64)
    with torch.no_grad():
        logits = model(ids).logits
    logits.double().numpy().astype("<f8").tofile(out_bin)
    print(type(model).__name__)


def mixtral(model_dir, ids_json, out_dir):
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    import transformers
    from transformers import MixtralForCausalLM
    transformers.utils.logging.disable_progress_bar()
    torch.set_default_dtype(torch.float64)  # torch 1.13 builds the float64 mask in the default dtype
    model = MixtralForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64)
    model.train()  # no dropout in Mixtral; train() only enables the loss paths
    ids = torch.tensor(json.load(open(ids_json))["ids"], dtype=torch.int64)

    def run(router_logits):
        model.zero_grad()
        out = model(ids, labels=ids, output_router_logits=router_logits)
        out.loss.backward()
        return out, {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    plain, plain_grads = run(False)
    out, grads = run(True)
    diff = max(float((grads[n] - plain_grads[n]).abs().max()) for n in grads)

    # The Switch / GShard load-balancing loss per layer (docs/moe.md), written here from
    # the router logits transformers returns: E sum_e f_e P_e, f_e = (tokens choosing e) / N
    # (a constant), P_e = mean softmax probability; the model's loss adds
    # coef * the sum over layers to the cross entropy.
    model.zero_grad()
    out2 = model(ids, labels=ids, output_router_logits=True)
    coef = model.config.router_aux_loss_coef
    E, k = model.config.num_local_experts, model.config.num_experts_per_tok
    switch = []
    for logits in out2.router_logits:
        probs = torch.softmax(logits, dim=-1)
        chosen = torch.topk(logits, k, dim=-1).indices
        f = torch.nn.functional.one_hot(chosen, E).sum(dim=1).double().mean(dim=0)
        switch.append(E * (f * probs.mean(dim=0)).sum())
    total = out2.loss - coef * out2.aux_loss + coef * sum(switch)
    total.backward()

    os.makedirs(os.path.join(out_dir, "grad"), exist_ok=True)
    os.makedirs(os.path.join(out_dir, "grad_switch"), exist_ok=True)
    out.logits.detach().numpy().astype("<f8").tofile(os.path.join(out_dir, "logits.bin"))
    for n, g in grads.items():
        g.numpy().astype("<f8").tofile(os.path.join(out_dir, "grad", n + ".bin"))
    for n, p in model.named_parameters():
        p.grad.numpy().astype("<f8").tofile(os.path.join(out_dir, "grad_switch", n + ".bin"))
    json.dump({"class": type(model).__name__, "loss": float(out.loss), "ce": float(plain.loss),
               "aux_loss": float(out.aux_loss), "coef": coef, "grad_aux_diff": diff,
               "switch": [float(a) for a in switch]}, open(os.path.join(out_dir, "result.json"), "w"))


def main():
    if sys.argv[1] == "transformers":
        return transformers_logits(*sys.argv[2:5])
    if sys.argv[1] == "mixtral":
        return mixtral(*sys.argv[2:5])
    out = sys.argv[2]
    rng = np.random.default_rng(7)
    write_folder(os.path.join(out, "f32"), rng, "F32", tied=False, buffers=True)
    write_folder(os.path.join(out, "bf16"), rng, "BF16", tied=False, shards=3)
    write_folder(os.path.join(out, "f16"), rng, "F16", tied=True)


if __name__ == "__main__":
    main()
