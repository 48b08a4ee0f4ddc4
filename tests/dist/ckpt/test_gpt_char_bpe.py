#!/usr/bin/env python3
"""GPT-2 BPE data end to end: tokenize_text's shards and gpt_char --tokenizer against the
Python reference tokenizer (tests/unit/data/bpe_reference.py, on the regex module).

usage: test_gpt_char_bpe.py GPT_CHAR TOKENIZE_TEXT

  shards       tokenize_text on a text file (in 1000-byte parts on 3 threads) and a .jsonl
               file: the shards hold exactly [eot] + ids of each document, cut every
               --shard-tokens (first: validation), in llm.c's layout; OpenAI's file layout
               gives the same bytes; shards of an earlier run with the prefix are refused
               (removed with --overwrite); bad input (a line that is not JSON, a missing
               field, Latin-1 text, everything in one shard) fails naming the place
  text         gpt_char --data T --tokenizer trains bitwise like gpt_char on nanoGPT token
               files of the reference's ids of T (90% / 10%)
  sample       from that checkpoint, with the same seed: the text sample that continues
               --prompt "hello" (--tokenizer) is the reference's decoding of the id sample
               that continues the id of "hello" (no --tokenizer); with a vocabulary padded to
               4096 only the tokenizer's ids are sampled (the sample decodes)
  export       --export-hf writes a folder with the tokenizer's files and vocabulary size, and
               --init-from the folder with --steps 0 (evaluation only) validates as the run ended
  refused      a missing tokenizer, a --vocab-size below the tokenizer's and --prompt with
               token files but no tokenizer fail before training"""
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "unit", "data"))
import bpe_reference  # noqa: E402
from test_gpt_char_resume import TINY, Failure  # noqa: E402  (the same tiny model)

TIMEOUT_S = 120


def tiny(**changes):
    """TINY with flags changed: tiny(sample_tokens=40) sets --sample-tokens 40."""
    flags = list(TINY)
    for key, value in changes.items():
        flags[flags.index("--" + key.replace("_", "-")) + 1] = str(value)
    return flags


def run(argv, what, expect=0):
    """argv's exit code, stdout and stderr (bytes); a hang or an unexpected code fails."""
    try:
        p = subprocess.run(argv, capture_output=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise Failure(f"{what}: no exit within {TIMEOUT_S} s (hang)")
    if expect is not None and p.returncode != expect:
        raise Failure(f"{what}: exit code {p.returncode}, expected {expect}\n{p.stdout.decode(errors='replace')}\n"
                      f"{p.stderr.decode(errors='replace')}")
    return p.returncode, p.stdout, p.stderr


class Reference:
    """The reference tokenizer read back from the files it wrote."""

    def __init__(self, folder):
        self.vocab = json.load(open(os.path.join(folder, "vocab.json"), encoding="utf-8"))
        lines = open(os.path.join(folder, "merges.txt"), encoding="utf-8").read().split("\n")[1:]
        self.ranks = {tuple(m.split(" ")): i for i, m in enumerate(l for l in lines if l)}
        self.tokens = {i: t for t, i in self.vocab.items()}

    def encode(self, text):
        return bpe_reference.encode(text, self.ranks, self.vocab)

    def decode(self, ids):
        return b"".join(bytes(bpe_reference.U2B[c] for c in self.tokens[i]) for i in ids)


def read_shard(path):
    data = open(path, "rb").read()
    magic, version, count = struct.unpack("<3i", data[:12])
    if magic != 20240520 or version != 1 or len(data) != 1024 + 2 * count:
        raise Failure(f"{path}: header {magic}, {version}, {count} and {len(data)} bytes: not an llm.c uint16 shard")
    return list(struct.unpack(f"<{count}H", data[1024:]))


def case_shards(tool, ref_dir, ref, work):
    corpus = os.path.join(ref_dir, "corpus.txt")
    docs = ["hello world", "données 日本 😀\n", "the tokenizer's training"]
    jsonl = os.path.join(work, "docs.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": docs[0]}) + "\n\n" + "".join(json.dumps({"text": d, "id": 7}) + "\n"
                                                                  for d in docs[1:]))
    eot = ref.vocab["<|endoftext|>"]
    want = [eot] + ref.encode(open(corpus, encoding="utf-8", newline="").read())
    for d in docs:
        want += [eot] + ref.encode(d)
    n = 20000
    for layout in ("hf", "openai"):
        out = os.path.join(work, f"shards-{layout}", "doc")
        os.makedirs(os.path.dirname(out))
        _, stdout, _ = run([tool, "--tokenizer", os.path.join(ref_dir, layout), "--out", out, "--shard-tokens", str(n),
                            "--threads", "3", "--part-bytes", "1000", corpus, jsonl], f"shards ({layout})")
        names = sorted(os.listdir(os.path.dirname(out)))
        expect = ["doc_train_%06d.bin" % i for i in range(1, (len(want) + n - 1) // n)] + ["doc_val_000000.bin"]
        if names != expect:
            raise Failure(f"shards ({layout}): files {names}, expected {expect}")
        got = read_shard(out + "_val_000000.bin")
        for i in range(1, len(expect)):
            got += read_shard(out + "_train_%06d.bin" % i)
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise Failure(f"shards ({layout}): {len(got)} tokens, expected {len(want)}; first difference at {first}")
        if b"4 documents" not in stdout or f"-> {len(want)} tokens".encode() not in stdout:
            raise Failure(f"shards ({layout}): the summary does not say 4 documents, {len(want)} tokens:\n{stdout}")
        print(f"ok   shards ({layout}): {len(want)} tokens in {len(expect)} shards equal the reference's ids")

    # Again into the same prefix: refused, then with --overwrite the earlier shards go (here: all but one).
    again = [tool, "--tokenizer", os.path.join(ref_dir, "hf"), "--out", out, "--shard-tokens", str(len(want) - 1), corpus,
             jsonl]
    rc, _, err = run(again, "shards again", None)
    if rc == 0 or b"--overwrite" not in err:
        raise Failure(f"shards again: exit code {rc}, expected != 0 naming --overwrite\n{err.decode()}")
    run(again + ["--overwrite"], "shards again --overwrite")
    names = sorted(os.listdir(os.path.dirname(out)))
    if names != ["doc_train_000001.bin", "doc_val_000000.bin"]:
        raise Failure(f"shards --overwrite: files {names}; the earlier run's shards remain")
    print("ok   shards: an earlier run's shards are refused, and removed with --overwrite")

    bad_json = os.path.join(work, "bad.jsonl")
    with open(bad_json, "wb") as f:
        f.write(b'{"text": "fine"}\n{"text": "fine too"}\n\n{"text": "caf\\udce9"}\n')  # a lone surrogate
    bad_utf8 = os.path.join(work, "latin1.txt")
    with open(bad_utf8, "wb") as f:
        f.write("café".encode("latin-1"))
    no_field = os.path.join(work, "nofield.jsonl")
    with open(no_field, "w") as f:
        f.write('{"text": "ok"}\n{"body": "ok"}\n')
    hf = os.path.join(ref_dir, "hf")
    for args, want_err in (([bad_json], "bad.jsonl:4 is not JSON"),
                           ([corpus, bad_utf8], "latin1.txt: [ptrain.data.bpe.utf8] byte 3 (0xe9)"),
                           ([no_field], 'nofield.jsonl:2 has no string field "text"'),
                           ([corpus, "--shard-tokens", "100000000"], "[tokenize_text.split]")):
        rc, _, err = run([tool, "--tokenizer", hf, "--out", os.path.join(work, "bad")] + args, f"refused {args}", None)
        if rc == 0 or want_err.encode() not in err:
            raise Failure(f"shards: {args}: exit code {rc}, expected != 0 and '{want_err}'\n{err.decode()}")
        print(f"ok   shards: '{want_err}' refused (exit {rc})")


def sample_of(stdout):
    return stdout.split(b"--- sample", 1)[1].split(b"---\n", 1)[1].rsplit(b"\n--------------", 1)[0]


def case_text_and_sample(exe, ref_dir, ref, work):
    corpus = os.path.join(ref_dir, "corpus.txt")
    hf = os.path.join(ref_dir, "hf")
    ids = ref.encode(open(corpus, encoding="utf-8", newline="").read())
    n_val = len(ids) // 10
    vocab = str(len(ref.vocab))
    d = os.path.join(work, "text")
    os.makedirs(d)
    prompt = ref.encode("hello")
    if len(prompt) != 1:
        raise Failure(f"the reference vocabulary has no single token for 'hello' ({prompt}); the test needs one")
    for name, toks in (("train.bin", ids[:-n_val]), ("val.bin", ids[-n_val:]), ("val-hello.bin", prompt + ids[-n_val:])):
        with open(os.path.join(d, name), "wb") as f:
            f.write(struct.pack(f"<{len(toks)}H", *toks))
    common = TINY + ["--steps", "12", "--checkpoint-every", "4"]
    a, b = os.path.join(d, "ckpt-text"), os.path.join(d, "ckpt-tokens")
    _, out, _ = run([exe, "--data", corpus, "--tokenizer", hf, "--checkpoint-dir", a] + common, "text")
    if f"{len(ids)} GPT-2 BPE tokens".encode() not in out:
        raise Failure(f"text: the run does not report the reference's {len(ids)} tokens:\n{out.decode()}")
    run([exe, "--train-tokens", os.path.join(d, "train.bin"), "--val-tokens", os.path.join(d, "val.bin"),
         "--vocab-size", vocab, "--checkpoint-dir", b] + common, "token files")
    for f in ("model.safetensors", "optimizer.safetensors"):
        fa, fb = (open(os.path.join(c, "step-00000012", f), "rb").read() for c in (a, b))
        if fa != fb:
            raise Failure(f"text: step 12's {f} differs between --data --tokenizer and the reference's token files")
    print(f"ok   text: --data with --tokenizer ({len(ids)} tokens) trains bitwise like the reference's token files")

    # Resumed at its last step: no training, only the sample.
    val = ["--val-tokens", os.path.join(d, "val-hello.bin")]
    flags = [exe, "--train-tokens", os.path.join(d, "train.bin"), "--checkpoint-dir", b, "--resume", "--steps", "12",
             "--temperature", "1", "--top-k", "0"] + tiny(sample_tokens=40) + val
    _, out_ids, _ = run(flags + ["--vocab-size", vocab], "sample as ids")
    _, out_text, _ = run(flags + ["--tokenizer", hf, "--prompt", "hello"], "sample as text")
    sample_ids = [int(t) for t in sample_of(out_ids).split()]
    if sample_ids[0] != prompt[0] or len(sample_ids) != 41:
        raise Failure(f"sample: the id sample {sample_ids} does not continue {prompt} by 40 tokens")
    want = ref.decode(sample_ids)
    got = sample_of(out_text)
    if got != want:
        raise Failure(f"sample: --tokenizer printed {got!r}, the reference decodes the ids to {want!r}")
    print(f"ok   sample: {got[:30]!r}... is the reference's decoding of the id sample")

    # A vocabulary padded far beyond the tokenizer's: the sample keeps to the tokenizer's ids.
    _, out, _ = run([exe, "--data", corpus, "--tokenizer", hf, "--vocab-size", "4096", "--steps", "2", "--temperature",
                     "1", "--top-k", "0"] + tiny(sample_tokens=100), "padded vocabulary")
    if b"--- sample ---" not in out:
        raise Failure(f"padded vocabulary: no text sample:\n{out.decode(errors='replace')}")
    print("ok   sample: with --vocab-size 4096 the sample decodes (only the tokenizer's ids are sampled)")
    return d


def final_loss(out):
    return out.split(b"final val_loss ", 1)[1].split()[0] if b"final val_loss " in out else None


def case_export(exe, ref_dir, ref, work):
    corpus = os.path.join(ref_dir, "corpus.txt")
    hf = os.path.join(ref_dir, "hf")
    folder = os.path.join(work, "export-hf")
    flags = [exe, "--data", corpus, "--tokenizer", hf] + tiny(dropout=0)
    _, out, _ = run(flags + ["--steps", "12", "--export-hf", folder], "export")
    config = json.load(open(os.path.join(folder, "config.json")))
    if config["vocab_size"] != len(ref.vocab) or config["n_layer"] != 1 or config["n_embd"] != 32:
        raise Failure(f"export: config.json {config} does not describe the model")
    for f in ("vocab.json", "merges.txt"):
        if open(os.path.join(folder, f), "rb").read() != open(os.path.join(hf, f), "rb").read():
            raise Failure(f"export: {f} is not the tokenizer's")
    _, again, _ = run(flags + ["--steps", "0", "--init-from", folder], "evaluate the export (--steps 0)")
    if final_loss(out) is None or final_loss(again) != final_loss(out):
        raise Failure(f"export: --init-from the folder validates at {final_loss(again)}, the run ended at "
                      f"{final_loss(out)}")
    print(f"ok   export: the Hugging Face folder validates as the run ended ({final_loss(out).decode()})")


def case_refused(exe, ref_dir, d):
    hf = os.path.join(ref_dir, "hf")
    tokens = ["--train-tokens", os.path.join(d, "train.bin"), "--val-tokens", os.path.join(d, "val.bin")]
    for args, code, want in ((["--tokenizer", os.path.join(d, "none")], 1, "[ptrain.tokenizer.missing]"),
                             (tokens + ["--tokenizer", hf, "--vocab-size", "100"], 1, "[gpt_char.vocab]"),
                             (tokens + ["--vocab-size", "1000", "--prompt", "hi"], 2, "requires --tokenizer")):
        rc, out, err = run([exe] + TINY + ["--steps", "2"] + args, f"refused {args}", None)
        if rc != code or want.encode() not in err or b"step " in out:
            raise Failure(f"refused: {args}: exit code {rc}, expected {code}, '{want}' and no training\n{err.decode()}")
        print(f"ok   refused: {want} (exit {rc})")


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    exe, tool = (os.path.abspath(a) for a in sys.argv[1:])
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="gpt_char_bpe.") as work:
        ref_dir = os.path.join(work, "ref")
        bpe_reference.main_to(ref_dir, classes=False)
        ref = Reference(os.path.join(ref_dir, "hf"))
        try:
            case_shards(tool, ref_dir, ref, work)
            d = case_text_and_sample(exe, ref_dir, ref, work)
            case_export(exe, ref_dir, ref, work)
            case_refused(exe, ref_dir, d)
        except Failure as e:
            print(f"FAIL {e}")
            return 1
    print(f"all cases passed in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
