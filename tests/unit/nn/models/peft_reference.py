"""Reference for the PEFT tests in tests/unit/nn/models/test_lora_peft.cpp: LoRA adapters
read and written by peft 0.7.1 on transformers 4.36.2 (tools/install-deps.sh --test puts
both on PYTHONPATH's test tools folder; the caller sets PYTHONPATH).

usage: peft_reference.py read BASE_DIR ADAPTER_DIR IDS_JSON OUT_BIN
       peft_reference.py write BASE_DIR ADAPTER_DIR IDS_JSON OUT_BIN R ALPHA TARGETS

read:  PeftModel.from_pretrained(AutoModelForCausalLM(BASE_DIR), ADAPTER_DIR) in float64;
       writes its logits on the ids of IDS_JSON ({"ids": [[...], ...]}) to OUT_BIN
       (raw float64), and prints the number of LoRA modules PEFT attached.
write: get_peft_model(AutoModelForCausalLM(BASE_DIR), LoraConfig(r=R, lora_alpha=ALPHA,
       target_modules=TARGETS (comma-separated), init_lora_weights=False)): both A and B
       random (torch's Linear init, seed 7), saved by save_pretrained(ADAPTER_DIR) as
       adapter_model.safetensors + adapter_config.json; writes the logits as for read.
"""
import json
import sys


def logits(model, ids_json, out_bin):
    import torch
    ids = torch.tensor(json.load(open(ids_json))["ids"], dtype=torch.int64)
    with torch.no_grad():
        out = model(input_ids=ids).logits
    out.double().numpy().tofile(out_bin)


def base_model(base_dir):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    transformers.utils.logging.disable_progress_bar()
    torch.set_default_dtype(torch.float64)  # torch 1.13 builds the float64 mask in the default dtype
    return AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float64)


def lora_modules(model):
    import peft
    return sum(isinstance(m, peft.tuners.lora.LoraLayer) for m in model.modules())


def main():
    mode, base_dir, adapter_dir, ids_json, out_bin = sys.argv[1:6]
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    base = base_model(base_dir)
    if mode == "read":
        model = PeftModel.from_pretrained(base, adapter_dir)
    elif mode == "write":
        r, alpha, targets = int(sys.argv[6]), float(sys.argv[7]), sys.argv[8].split(",")
        torch.manual_seed(7)
        config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                            init_lora_weights=False, task_type="CAUSAL_LM")
        model = get_peft_model(base, config)
        model.save_pretrained(adapter_dir, safe_serialization=True)
    else:
        raise SystemExit("peft_reference.py: unknown mode " + mode)
    model.eval()
    logits(model, ids_json, out_bin)
    print(lora_modules(model))


if __name__ == "__main__":
    main()
