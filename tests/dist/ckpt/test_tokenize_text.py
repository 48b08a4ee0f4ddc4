#!/usr/bin/env python3
"""tokenize_text with Llama 3's and SentencePiece tokenizers: the shards hold exactly
[separator] + the reference's ids of each document (tests/unit/data/llama3_reference.py on
the regex module, sentencepiece_reference.py on Google's Python package).

usage: test_tokenize_text.py TOKENIZE_TEXT

  llama3         a tokenizer.json folder and a tiktoken file: a 1.8 MB text file (in
                 10000-byte parts on 3 threads) and a .jsonl file; <|begin_of_text|> before
                 each document by default, --separator '<|eot_id|>' when named
  sentencepiece  BPE and unigram models: the text file whole, the .jsonl documents;
                 the model's BOS before each document
  refused        --separator naming no token fails, saying so"""
import json
import os
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "unit", "data"))
import llama3_reference  # noqa: E402
import sentencepiece_reference  # noqa: E402


class Failure(Exception):
    pass


def run(argv, what, expect=0):
    p = subprocess.run(argv, capture_output=True, timeout=120)
    if expect is not None and p.returncode != expect:
        raise Failure(f"{what}: exit code {p.returncode}, expected {expect}\n{p.stdout.decode(errors='replace')}\n"
                      f"{p.stderr.decode(errors='replace')}")
    return p.returncode, p.stdout, p.stderr


def read_shards(prefix):
    folder, stem = os.path.split(prefix)
    names = sorted(n for n in os.listdir(folder) if n.startswith(stem + "_"))
    names = [n for n in names if "_val_" in n] + [n for n in names if "_train_" in n]
    ids = []
    for n in names:
        data = open(os.path.join(folder, n), "rb").read()
        magic, version, count = struct.unpack("<3i", data[:12])
        width = {1: 2, 2: 4}.get(version)
        if magic != 20240520 or width is None or len(data) != 1024 + width * count:
            raise Failure(f"{n}: header {magic}, {version}, {count}, {len(data)} bytes: not an llm.c shard")
        ids += list(struct.unpack(f"<{count}{'H' if width == 2 else 'I'}", data[1024:]))
    return ids


def check(tool, work, name, tokenizer, corpus, corpus_ids, docs, sep, extra=()):
    jsonl = os.path.join(work, name + ".jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        f.write("".join(json.dumps({"text": t}) + "\n" for t, _ in docs))
    want = [sep] + corpus_ids
    for _, ids in docs:
        want += [sep] + ids
    out = os.path.join(work, name, "doc")
    os.makedirs(os.path.dirname(out))
    run([tool, "--tokenizer", tokenizer, "--out", out, "--shard-tokens", str(len(want) // 3), "--threads", "3",
         "--part-bytes", "10000", corpus, jsonl] + list(extra), name)
    got = read_shards(out)
    if got != want:
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise Failure(f"{name}: {len(got)} tokens, expected {len(want)}; first difference at {first}")
    print(f"ok   {name}: {len(want)} tokens equal the reference's ids")


def main(tool):
    with tempfile.TemporaryDirectory() as work:
        l3 = os.path.join(work, "llama3")
        os.makedirs(l3)
        llama3_reference.main(l3)
        cases = json.load(open(os.path.join(l3, "cases.json")))
        docs = [c for c in cases if c["text"].strip()][:60]
        corpus = os.path.join(l3, "corpus.txt")
        for name, path, key in (("tokenizer.json", os.path.join(l3, "hf"), "hf"),
                                ("tiktoken", os.path.join(l3, "tokenizer.model"), "tiktoken")):
            if key == "hf":
                added = json.load(open(os.path.join(path, "tokenizer.json")))["added_tokens"]
                special = {a["content"]: a["id"] for a in added}
            else:
                n = sum(1 for line in open(path) if line.strip())
                special = {s: n + i for i, s in enumerate(llama3_reference.SPECIALS)}
            bos = special["<|begin_of_text|>"]
            corpus_ids = json.load(open(os.path.join(l3, f"corpus.{key}.json")))
            pairs = [(c["text"], c[key]) for c in docs]
            check(tool, work, "llama3-" + key, path, corpus, corpus_ids, pairs, bos)
            check(tool, work, "llama3-eot-" + key, path, corpus, corpus_ids, pairs, special["<|eot_id|>"],
                  ["--separator", "<|eot_id|>"])

        sp = os.path.join(work, "spm")
        os.makedirs(sp)
        sentencepiece_reference.main(sp)
        ref = json.load(open(os.path.join(sp, "cases.json")))
        for kind in ("bpe", "unigram"):
            pairs = [(c["text"], c["ids"]) for c in ref[kind]["cases"] if c["text"].strip()][:60]
            corpus_ids = json.load(open(os.path.join(sp, f"corpus.{kind}.json")))
            check(tool, work, "sentencepiece-" + kind, os.path.join(sp, kind + ".model"),
                  os.path.join(sp, "corpus.txt"), corpus_ids, pairs, ref[kind]["bos"])

        rc, _, err = run([tool, "--tokenizer", os.path.join(l3, "hf"), "--out", os.path.join(work, "bad"),
                          "--separator", "<|nope|>", corpus], "refused", None)
        if rc == 0 or b"[tokenize_text.eot]" not in err or b"<|nope|>" not in err:
            raise Failure(f"refused: exit code {rc}, expected != 0 naming <|nope|>\n{err.decode()}")
        print(f"ok   refused: --separator '<|nope|>' (exit {rc})")


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except Failure as e:
        print(f"FAIL {e}")
        sys.exit(1)
