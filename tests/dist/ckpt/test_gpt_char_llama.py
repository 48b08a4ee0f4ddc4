#!/usr/bin/env python3
"""gpt_char --model llama end to end: training in a sharded mode, the way out to a
Hugging Face folder and back in, and the flags it refuses.

usage: test_gpt_char_llama.py GPT_CHAR [MPIRUN]

  learns     2 ranks under FSDP (MPIRUN; one process without it) on the fortunes corpus:
             the final validation loss is below the unigram entropy, which no model that
             ignores the context can reach
  export     --export-hf writes config.json (LlamaForCausalLM, the flags' shape) and
             model.safetensors (the tensors under Hugging Face's names); --init-from that
             folder with --steps 0, on one process, validates as the run ended (the shape
             comes from config.json: the shape flags are left out)
  resume     a checkpoint of a Llama run resumes under DDP; one of a GPT run is refused
  tp         (with MPIRUN) it resumes again at tp 2 with sequence parallelism, learns, and
             exports the gathered model with the same names and shapes
  bf16       --precision bf16 (bf16 parameters, fp32 master weights) learns too, under FSDP
             and (with MPIRUN) at tp 2 with sequence parallelism
  refused    --dropout and --kv-heads without --model llama fail before training, naming
             the flag"""
import json
import os
import sys
import tempfile

from gpt_char_util import Failure, final, run, run_main, safetensors_names

SHAPE = ["--layers", "2", "--embd", "48", "--heads", "4", "--kv-heads", "2", "--block", "48"]
TRAIN = ["--model", "llama", "--batch", "8", "--lr", "3e-3", "--warmup", "10", "--eval-every", "0",
         "--eval-batches", "4", "--log-every", "0", "--sample-tokens", "20", "--seed", "5"]


def main():
    exe = sys.argv[1]
    launch = [sys.argv[2], "--oversubscribe", "-np", "2"] if len(sys.argv) > 2 else []
    work = tempfile.mkdtemp(prefix="ptrain_gpt_char_llama_")
    hf = os.path.join(work, "hf")
    ckpt = os.path.join(work, "ckpt")
    parallel = ["--parallel", "fsdp"] if launch else []

    # learns, and exports
    out = run(launch + [exe] + TRAIN + SHAPE + parallel + ["--steps", "120", "--export-hf", hf,
                                                           "--checkpoint-dir", ckpt],
              "training under fsdp")
    loss, ratio = final(out, "training")
    if ratio >= 1.0:
        raise Failure(f"training: final val_loss {loss} is {ratio} x the unigram entropy; it did not learn\n{out}")
    if "--- sample ---" not in out:
        raise Failure(f"training: no sample printed\n{out}")

    # export
    with open(os.path.join(hf, "config.json")) as f:
        config = json.load(f)
    want = {"architectures": ["LlamaForCausalLM"], "hidden_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2}
    for key, value in want.items():
        if config.get(key) != value:
            raise Failure(f"export: config.json has {key} = {config.get(key)}, expected {value}")
    names = safetensors_names(os.path.join(hf, "model.safetensors"))
    for name in ["model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.weight", "model.norm.weight"]:
        if name not in names:
            raise Failure(f"export: model.safetensors has no {name}; it has {sorted(names)}")
    if names["model.layers.1.self_attn.k_proj.weight"] != [2 * 12, 48]:
        raise Failure(f"export: k_proj has shape {names['model.layers.1.self_attn.k_proj.weight']}, expected [24, 48]")
    back = run([exe] + TRAIN + ["--steps", "0", "--block", "48", "--init-from", hf], "--init-from the exported folder")
    back_loss, _ = final(back, "--init-from")
    if abs(back_loss - loss) > 1e-4 * loss:
        raise Failure(f"export: the folder validates at {back_loss}, the run ended at {loss}\n{back}")

    # resume: the Llama checkpoint under ddp; a GPT's is refused
    more = run(launch + [exe] + TRAIN + SHAPE + (["--parallel", "ddp"] if launch else []) +
               ["--steps", "130", "--checkpoint-dir", ckpt, "--resume"], "resume under ddp")
    if "resumed from" not in more or "step 120" not in more:
        raise Failure(f"resume: did not resume from step 120\n{more}")
    # tensor parallel: the same checkpoint resumes at tp 2 with sequence parallelism, and
    # the gathered model exports with full shapes
    if launch:
        hf_tp = os.path.join(work, "hf_tp")
        tp = run(launch + [exe] + TRAIN + SHAPE + ["--parallel", "tp", "--tp", "2", "--sequence-parallel", "--steps",
                                                   "140", "--checkpoint-dir", ckpt, "--resume", "--export-hf", hf_tp],
                 "resume under tp 2 with sequence parallelism")
        if "resumed from" not in tp or "tensor parallel, tp 2" not in tp or "sequence parallel" not in tp:
            raise Failure(f"tp: did not resume from step 130 under tensor parallelism\n{tp}")
        tp_loss, tp_ratio = final(tp, "tp")
        if tp_ratio >= 1.0:
            raise Failure(f"tp: final val_loss {tp_loss} is {tp_ratio} x the unigram entropy\n{tp}")
        if safetensors_names(os.path.join(hf_tp, "model.safetensors")) != names:
            raise Failure("tp: the exported tensors differ in names or shapes from the fsdp run's")
        tp_back = run([exe] + TRAIN + ["--steps", "0", "--block", "48", "--init-from", hf_tp], "--init-from the tp export")
        if abs(final(tp_back, "--init-from the tp export")[0] - tp_loss) > 1e-4 * tp_loss:
            raise Failure(f"tp: the exported folder does not validate as the tp run ended\n{tp_back}")

    gpt_ckpt = os.path.join(work, "gpt_ckpt")
    run([exe, "--steps", "2", "--layers", "1", "--embd", "32", "--block", "16", "--eval-batches", "1",
         "--sample-tokens", "0", "--log-every", "0", "--checkpoint-dir", gpt_ckpt], "a GPT run")
    refused = run([exe] + TRAIN + SHAPE + ["--steps", "3", "--checkpoint-dir", gpt_ckpt, "--resume"],
                  "a Llama resuming a GPT checkpoint", expect=1)
    if "[ptrain.example.config]" not in refused or "--model" not in refused:
        raise Failure(f"resume: a GPT checkpoint was not refused by name\n{refused}")

    bf16 = run(launch + [exe] + TRAIN + SHAPE + parallel + ["--precision", "bf16", "--steps", "120"],
               "training in bf16")
    bf16_loss, bf16_ratio = final(bf16, "training in bf16")
    if bf16_ratio >= 1.0:
        raise Failure(f"bf16: final val_loss {bf16_loss} is {bf16_ratio} x the unigram entropy; it did not "
                      f"learn\n{bf16}")
    if launch:
        tp16 = run(launch + [exe] + TRAIN + SHAPE + ["--parallel", "tp", "--tp", "2", "--sequence-parallel",
                                                     "--precision", "bf16", "--steps", "120"], "bf16 at tp 2")
        tp16_loss, tp16_ratio = final(tp16, "bf16 at tp 2")
        if tp16_ratio >= 1.0:
            raise Failure(f"bf16 at tp 2: final val_loss {tp16_loss} is {tp16_ratio} x the unigram entropy\n{tp16}")

    # refused flags
    out = run([exe] + TRAIN + SHAPE + ["--dropout", "0.1", "--steps", "1"], "--model llama --dropout", expect=2)
    if "--dropout" not in out:
        raise Failure(f"refused: --dropout failed without naming it\n{out}")
    out = run([exe, "--kv-heads", "2", "--steps", "1"], "--kv-heads with a GPT", expect=2)
    if "--model llama" not in out:
        raise Failure(f"refused: --kv-heads with a GPT failed without naming --model llama\n{out}")
    print(f"gpt_char --model llama: final val_loss {loss:.4f} ({ratio:.3f} x unigram entropy), bf16 "
          f"{bf16_loss:.4f} ({bf16_ratio:.3f}), the exported folder {back_loss:.4f}; resume and refusals as expected")


if __name__ == "__main__":
    run_main(main)
