#!/usr/bin/env python3
"""gpt_char --model mixtral end to end: a Llama with mixture-of-experts blocks learns on
4 data-parallel ranks, reports its routing in the metrics, and goes out to a Hugging Face
Mixtral folder and back in.

usage: test_gpt_char_mixtral.py GPT_CHAR [MPIRUN]

  learns     4 ranks under DDP (MPIRUN; one process without it) on the fortunes corpus,
             4 experts, top-2, capacity factor 1.25: the final validation loss is below the
             unigram entropy, which no model that ignores the context can reach
  metrics    each step record holds every MoE layer's routing over all ranks: tokens_per_expert.e
             summing to ranks x batch x block x k slots, dropped between the bounds that the
             per-rank capacity ceil(1.25 x tokens x k / experts) and those summed counts give
             (exact on one process), load_imbalance = max / mean of the counts, moe_loss =
             coefficient x aux_loss
  export     --export-hf writes a MixtralForCausalLM config.json and the experts under
             Hugging Face's names; --init-from that folder with --steps 0, on one process,
             validates as the run ended
  ep resume  (4 ranks, dropless: plain DDP applies a capacity to each rank's tokens, expert
             parallelism to the global batch) --expert-parallel 2 (ep 2 x dp 2) checkpoints at
             step 3 of 5; resumed from there at ep 1 (plain DDP), steps 4 and 5 have the ep 2
             run's losses (1e-4 relative)
  refused    MoE flags without --model mixtral, --model mixtral with --context-parallel, and
             --expert-parallel without --parallel ddp or not dividing the world, fail before
             training, naming the flag"""
import json
import math
import os
import shutil
import sys
import tempfile

from gpt_char_util import Failure, final, run, run_main, safetensors_names

BATCH, BLOCK, EXPERTS, TOP_K, CAPACITY, AUX = 8, 32, 4, 2, 1.25, 0.01
SHAPE = ["--layers", "2", "--embd", "32", "--heads", "4", "--kv-heads", "2", "--intermediate", "32",
         "--block", str(BLOCK)]
MOE = ["--model", "mixtral", "--experts", str(EXPERTS), "--moe-top-k", str(TOP_K), "--capacity-factor",
       str(CAPACITY), "--aux-loss-coef", str(AUX)]
TRAIN = ["--batch", str(BATCH), "--lr", "1e-2", "--warmup", "10", "--eval-every", "0", "--eval-batches", "4",
         "--log-every", "0", "--sample-tokens", "20", "--seed", "5"]


def check_routing(rec, ranks):
    tokens = BATCH * BLOCK  # each rank's tokens per forward
    capacity = math.ceil(CAPACITY * tokens * TOP_K / EXPERTS)  # each rank's, per expert
    for layer in range(2):
        p = f"layers.{layer}.block_sparse_moe."
        counts = [rec.get(f"{p}tokens_per_expert.{e}") for e in range(EXPERTS)]
        if None in counts or f"{p}tokens_per_expert.{EXPERTS}" in rec:
            raise Failure(f"metrics: step {rec['step']} lacks {EXPERTS} tokens_per_expert fields of layer {layer}: {rec}")
        if sum(counts) != ranks * tokens * TOP_K:
            raise Failure(f"metrics: layer {layer} routed {sum(counts)} slots, expected {ranks * tokens * TOP_K}: "
                          f"{counts}")
        # Every rank keeps at most `capacity` slots of an expert, and one that drops keeps that many.
        least = sum(max(0, c - ranks * capacity) for c in counts)
        most = sum(max(0, c - capacity) for c in counts)
        if not least <= rec[p + "dropped"] <= most:
            raise Failure(f"metrics: layer {layer} dropped {rec[p + 'dropped']}, expected {least} .. {most} of "
                          f"{counts} at capacity {capacity} on each of {ranks} ranks")
        imbalance = max(counts) / (ranks * tokens * TOP_K / EXPERTS)
        if abs(rec[p + "load_imbalance"] - imbalance) > 1e-12:
            raise Failure(f"metrics: layer {layer} load_imbalance {rec[p + 'load_imbalance']}, expected {imbalance}")
        if abs(rec[p + "moe_loss"] - AUX * rec[p + "aux_loss"]) > 1e-9 or not 1.0 <= rec[p + "aux_loss"] < EXPERTS:
            raise Failure(f"metrics: layer {layer} aux_loss {rec[p + 'aux_loss']}, moe_loss {rec[p + 'moe_loss']}")


def step_losses(path):
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def check_ep_resume(exe, launch, work):
    """A checkpoint of ep 2 x dp 2 resumed at ep 1 (plain DDP) on the same 4 ranks continues with
    the losses of the uninterrupted ep 2 run."""
    steps = ["--steps", "5", "--checkpoint-every", "3"]
    dropless = MOE[:MOE.index("--capacity-factor")] + MOE[MOE.index("--capacity-factor") + 2:]
    ref, res = os.path.join(work, "ep2"), os.path.join(work, "ep1")
    run(launch + [exe] + dropless + TRAIN + SHAPE + steps + ["--parallel", "ddp", "--expert-parallel", "2",
        "--checkpoint-dir", ref, "--metrics", ref + ".jsonl"], "ep 2 with checkpoints")
    shutil.copytree(os.path.join(ref, "step-00000003"), os.path.join(res, "step-00000003"))
    out = run(launch + [exe] + dropless + TRAIN + SHAPE + steps + ["--parallel", "ddp", "--checkpoint-dir", res,
              "--resume", "--metrics", res + ".jsonl"], "ep 1 resuming ep 2's step 3")
    if "resumed from" not in out:
        raise Failure(f"ep resume: the ep 1 run did not resume\n{out}")
    want, got = step_losses(ref + ".jsonl"), step_losses(res + ".jsonl")
    for step in (4, 5):
        if step not in got or abs(got[step] - want[step]) > 1e-4 * want[step]:
            raise Failure(f"ep resume: step {step} loss {got.get(step)} at ep 1, {want[step]} at ep 2")


def main():
    exe = sys.argv[1]
    launch = [sys.argv[2], "--oversubscribe", "-np", "4"] if len(sys.argv) > 2 else []
    work = tempfile.mkdtemp(prefix="ptrain_gpt_char_mixtral_")
    hf = os.path.join(work, "hf")
    metrics = os.path.join(work, "m.jsonl")
    parallel = ["--parallel", "ddp"] if launch else []

    # learns, reports its routing, exports
    out = run(launch + [exe] + MOE + TRAIN + SHAPE + parallel +
              ["--steps", "200", "--export-hf", hf, "--metrics", metrics], "training")
    loss, ratio = final(out, "training")
    if ratio >= 1.0:
        raise Failure(f"training: final val_loss {loss} is {ratio} x the unigram entropy; it did not learn\n{out}")
    with open(metrics) as f:
        steps = [r for r in map(json.loads, f) if "loss" in r]
    if len(steps) != 200:
        raise Failure(f"metrics: {len(steps)} step records, expected 200")
    for rec in steps:
        check_routing(rec, 4 if launch else 1)

    with open(os.path.join(hf, "config.json")) as f:
        config = json.load(f)
    want = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": EXPERTS,
            "num_experts_per_tok": TOP_K, "router_aux_loss_coef": AUX, "output_router_logits": True}
    for key, value in want.items():
        if config.get(key) != value:
            raise Failure(f"export: config.json has {key} = {config.get(key)}, expected {value}")
    names = safetensors_names(os.path.join(hf, "model.safetensors"))
    for name, shape in [("model.layers.1.block_sparse_moe.gate.weight", [EXPERTS, 32]),
                        ("model.layers.0.block_sparse_moe.experts.3.w1.weight", [32, 32]),
                        ("model.layers.1.block_sparse_moe.experts.0.w2.weight", [32, 32])]:
        if names.get(name) != shape:
            raise Failure(f"export: {name} has shape {names.get(name)}, expected {shape}; names {sorted(names)}")
    back = run([exe] + MOE[:2] + MOE[6:8] + TRAIN + ["--steps", "0", "--block", str(BLOCK), "--init-from", hf],
               "--init-from the exported folder")
    back_loss, _ = final(back, "--init-from")
    if abs(back_loss - loss) > 1e-4 * loss:
        raise Failure(f"export: the folder validates at {back_loss}, the run ended at {loss}\n{back}")

    if launch:
        check_ep_resume(exe, launch, work)

    # refused
    for argv, flag in [(["--experts", "4"], "--experts"),
                       (["--model", "mixtral", "--context-parallel", "2"], "--parallel")]:
        err = run([exe] + argv + ["--steps", "1"], f"{argv}", expect=2)
        if flag not in err:
            raise Failure(f"refused: {argv} did not name {flag}\n{err}")
    refusals = [([exe, "--model", "mixtral", "--parallel", "none", "--expert-parallel", "2"], "--parallel none")]
    if launch:
        refusals.append((launch + [exe, "--model", "mixtral", "--parallel", "ddp", "--expert-parallel", "3"],
                         "world (4 ranks)"))
    for argv, says in refusals:
        err = run(argv + SHAPE + ["--steps", "1"], f"{argv}", expect=1)
        if "[gpt_char.ep]" not in err or says not in err:
            raise Failure(f"refused: {argv} did not fail with [gpt_char.ep] naming {says}\n{err}")
    print(f"mixtral learns on {4 if launch else 1} rank(s): val_loss {loss:.4f} = {ratio:.3f} x unigram entropy; "
          f"{len(steps)} records with the routing; the Hugging Face folder validates at {back_loss:.4f}")


if __name__ == "__main__":
    run_main(main)
