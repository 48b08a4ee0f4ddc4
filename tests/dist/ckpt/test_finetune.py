"""examples/finetune end to end: LoRA on a small random Llama that transformers built.

usage: test_finetune.py FINETUNE_BINARY [MPIEXEC]

transformers 4.36.2 writes a random LlamaForCausalLM folder, with a byte-level
tokenizer (Llama 3's tiktoken form: the 256 bytes, then Llama 3's special tokens,
so <|begin_of_text|> is 256 and <|eot_id|> 265); a few instruction records with
short answers are generated. finetune trains LoRA adapters under DDP on 2 ranks
(MPI) and under FSDP, until it answers every training prompt (--check-answers,
--min-answer-accuracy 1), and writes the adapter and a merged folder. Then peft
0.7.1 loads the adapter onto the same base, and transformers the merged folder,
and both must answer every training prompt with its answer, greedily, token for
token (the Llama 3 chat template built here by hand from the ids). The held-out
loss is reported; bad input is refused. Needs tools/install-deps.sh --test (torch,
transformers and peft on the test tools' PYTHONPATH).
"""
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile

TOOLS = os.path.join(os.environ.get("PTRAIN_TEST_TOOLS") or "/opt/ptrain-test-tools", "transformers")
sys.path.insert(0, TOOLS)

BOS, EOT, START, END = 256, 265, 262, 263
RECORDS = [("Capital of France?", "Paris"), ("Capital of Peru?", "Lima"), ("Colour of grass?", "green"),
           ("Two plus two?", "4"), ("Opposite of up?", "down"), ("First letter?", "A"),
           ("Largest planet?", "Jupiter"), ("Frozen water?", "ice"),
           ("Capital of Italy?", "Rome"), ("Colour of sky?", "blue")]  # the last two are held out


def byte_ids(text):
    return list(text.encode("utf-8"))


def prompt_ids(prompt):
    """Meta's Llama 3 chat template, user message then the assistant header, as ids."""
    return ([BOS, START] + byte_ids("user") + [END] + byte_ids("\n\n") + byte_ids(prompt) + [EOT, START] +
            byte_ids("assistant") + [END] + byte_ids("\n\n"))


def write_base(folder):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=EOT)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    with open(os.path.join(folder, "tokenizer.model"), "w") as f:
        for b in range(256):
            f.write(base64.b64encode(bytes([b])).decode() + " %d\n" % b)


def answers(model):
    """How many training prompts the model answers greedily with exactly their answer and <|eot_id|>."""
    import torch
    right = 0
    for prompt, answer in RECORDS[:-2]:
        ids = torch.tensor([prompt_ids(prompt)])
        want = byte_ids(answer) + [EOT]
        with torch.no_grad():
            out = model.generate(input_ids=ids, max_new_tokens=len(want), do_sample=False, pad_token_id=EOT)
        right += out[0, ids.shape[1]:].tolist() == want
    return right


def run(cmd, expect=0):
    print("+", " ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=500, env=env)
    print(p.stdout, flush=True)
    if p.returncode != expect:
        raise SystemExit("exit status %d, expected %d" % (p.returncode, expect))
    return p.stdout


def main():
    binary = sys.argv[1]
    mpiexec = sys.argv[2] if len(sys.argv) > 2 else None
    work = tempfile.mkdtemp(prefix="ptrain_finetune_")
    try:
        base = os.path.join(work, "base")
        write_base(base)
        data = os.path.join(work, "train.jsonl")
        with open(data, "w") as f:
            for prompt, answer in RECORDS:
                f.write(json.dumps({"prompt": prompt, "completion": answer}) + "\n")
        common = ["--model", base, "--data", data, "--eval-fraction", "0.2", "--seq-len", "64", "--batch", "2",
                  "--epochs", "80", "--lr", "1e-2", "--lora-r", "8", "--lora-alpha", "16", "--log-every", "0",
                  "--check-answers", "8", "--min-answer-accuracy", "1"]
        adapter, merged = os.path.join(work, "adapter"), os.path.join(work, "merged")
        launch = [mpiexec, "--oversubscribe", "-np", "2"] if mpiexec else []
        out = run(launch + [binary] + common + ["--parallel", "ddp" if mpiexec else "none", "--out", adapter,
                                                "--merged", merged, "--sample", "Capital of France?"])
        assert "answers: 8 of 8 right" in out, out
        assert "final eval_loss" in out, out
        if mpiexec:  # FSDP shards the frozen base and the adapters alike
            out = run(launch + [binary] + common + ["--parallel", "fsdp"])
            assert "answers: 8 of 8 right" in out, out

        import torch
        import transformers
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
        transformers.utils.logging.disable_progress_bar()
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32),
                                               adapter)
        peft_model.eval()
        assert answers(peft_model) == 8, "peft on ptrain's adapter answers %d of 8" % answers(peft_model)
        merged_model = AutoModelForCausalLM.from_pretrained(merged, torch_dtype=torch.float32)
        merged_model.eval()
        assert answers(merged_model) == 8, "the merged folder answers %d of 8" % answers(merged_model)
        print("peft and transformers answer 8 of 8 training prompts")

        # Bad input: a record without an answer, --out without LoRA.
        bad = os.path.join(work, "bad.jsonl")
        with open(bad, "w") as f:
            f.write(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
        out = run([binary, "--model", base, "--data", bad], expect=1)
        assert "[ptrain.instruct.record]" in out and "bad.jsonl:1" in out, out
        out = run([binary, "--model", base, "--data", data, "--lora-r", "0", "--out", adapter], expect=2)
        assert "--lora-r 0" in out, out
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
