#!/usr/bin/env python3
"""GPT-2 BPE tokenization throughput: tokenize_text against Hugging Face's `tokenizers`
(Rust, when the Python running this has it), same vocabulary, same documents.

usage: tokenize_bench.py TOKENIZE_TEXT [TOKENIZER_DIR] [--repeats N]

TOKENIZER_DIR holds vocab.json + merges.txt (e.g. GPT-2's); without it, the test
vocabulary of tests/unit/data/bpe_reference.py (300 merges) is written and used. The
documents: every fortune of Debian's `fortunes` package, 4 times, as JSON lines (one
document each) and as one text file. Prints one JSON line per measurement: median
seconds and MB/s over the repeats, tokens, threads."""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def fortunes():
    d = "/usr/share/games/fortunes"
    docs = []
    for f in sorted(os.listdir(d)):
        p = os.path.join(d, f)
        if f.endswith(".dat") or os.path.islink(p) or not os.path.isfile(p):
            continue
        text = open(p, encoding="utf-8", errors="replace").read()
        docs += [x.strip("\n") for x in text.split("\n%\n") if x.strip()]
    return docs * 4


def median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    repeats = int(sys.argv[sys.argv.index("--repeats") + 1]) if "--repeats" in sys.argv else 5
    if args and args[-1] == str(repeats):
        args.pop()
    tool = os.path.abspath(args[0])
    with tempfile.TemporaryDirectory(prefix="tokenize_bench.") as work:
        if len(args) > 1:
            tok_dir, vocab_name = args[1], "given"
        else:
            sys.path.insert(0, os.path.join(HERE, "..", "tests", "unit", "data"))
            import bpe_reference
            bpe_reference.main_to(os.path.join(work, "ref"), classes=False)
            tok_dir, vocab_name = os.path.join(work, "ref", "hf"), "test (300 merges)"
        docs = fortunes()
        jsonl, text = os.path.join(work, "docs.jsonl"), os.path.join(work, "docs.txt")
        with open(jsonl, "w") as f:
            f.write("".join(json.dumps({"text": d}) + "\n" for d in docs))
        with open(text, "w") as f:
            f.write("\n".join(docs))
        for kind, path in (("jsonl", jsonl), ("text", text)):
            nbytes = sum(len(d.encode()) for d in docs) if kind == "jsonl" else os.path.getsize(text)
            for threads in (1, os.cpu_count()):
                out = os.path.join(work, f"out-{kind}-{threads}")
                os.makedirs(out)
                cmd = [tool, "--tokenizer", tok_dir, "--out", os.path.join(out, "t"), "--shard-tokens",
                       "1000000", "--threads", str(threads), "--part-bytes", "2000000", "--overwrite", "--no-eot", path]
                secs, res = median_time(lambda: subprocess.run(cmd, capture_output=True, text=True, check=True),
                                        repeats)
                tokens = int(res.stdout.split("-> ")[1].split()[0])
                print(json.dumps({"bench": "tokenize", "impl": "ptrain", "input": kind, "threads": threads,
                                  "vocab": vocab_name, "mb": round(nbytes / 1e6, 2), "tokens": tokens,
                                  "median_s": round(secs, 4), "mb_per_s": round(nbytes / 1e6 / secs, 1)}))
                try:
                    from tokenizers import Tokenizer, models, pre_tokenizers
                except ImportError:
                    continue
                os.environ["RAYON_NUM_THREADS"] = str(threads)  # read when the first batch runs
                hf = Tokenizer(models.BPE.from_file(os.path.join(tok_dir, "vocab.json"),
                                                    os.path.join(tok_dir, "merges.txt")))
                hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
                inputs = docs if kind == "jsonl" else [open(text, encoding="utf-8").read()]
                secs, enc = median_time(lambda: hf.encode_batch(inputs), repeats)
                print(json.dumps({"bench": "tokenize", "impl": "hf_tokenizers", "input": kind, "threads": threads,
                                  "vocab": vocab_name, "mb": round(nbytes / 1e6, 2),
                                  "tokens": sum(len(e.ids) for e in enc), "median_s": round(secs, 4),
                                  "mb_per_s": round(nbytes / 1e6 / secs, 1)}))


if __name__ == "__main__":
    main()
