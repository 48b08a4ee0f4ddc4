#!/usr/bin/env python3
"""PyTorch reference of the masked, token-weighted loss: a bigram model
(embedding [V, D], then a linear layer D -> V) on token ids [B, S], and
F.cross_entropy(logits, targets, ignore_index=-100) over the whole batch, in float64,
with its gradients.

usage: masked_loss_reference.py IN.json OUT.json
IN.json: {"ids": [B][S], "targets": [B][S], "emb": [V][D], "weight": [V][D], "bias": [V]}
OUT.json: {"loss": float, "emb": [V][D], "weight": [V][D], "bias": [V]} (the gradients)
"""
import json
import sys

import torch
import torch.nn.functional as F


def main():
    with open(sys.argv[1]) as f:
        d = json.load(f)
    ids = torch.tensor(d["ids"], dtype=torch.long)
    targets = torch.tensor(d["targets"], dtype=torch.long)
    params = {k: torch.tensor(d[k], dtype=torch.float64, requires_grad=True) for k in ("emb", "weight", "bias")}
    logits = F.linear(F.embedding(ids, params["emb"]), params["weight"], params["bias"])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    loss.backward()
    out = {"loss": loss.item()}
    out.update({k: p.grad.tolist() for k, p in params.items()})
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
