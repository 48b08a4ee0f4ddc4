#!/usr/bin/env python3
"""Reference for ptrain's Llama 3 tokenizer (data/ranked_bpe.hpp): Llama 3's pre-tokenizer
pattern on Python's `regex` module, and the two BPE algorithms written from their
published descriptions: tiktoken's (merge the leftmost adjacent pair whose concatenation
has the lowest rank; a piece that has a rank is one token) and Hugging Face's BPE model
(merge the leftmost pair whose rule comes first; "ignore_merges": a piece in the
vocabulary is one token).

usage: llama3_reference.py OUT_DIR

- trains a byte-level BPE (500 merges) on generated multilingual text split by Llama 3's
  pattern, and writes it as OUT_DIR/tokenizer.model (tiktoken ranks: "base64 rank" lines,
  the single bytes in shuffled order first), OUT_DIR/hf/tokenizer.json (shuffled ids,
  merges as "a b", Llama 3's pre-tokenizer and 256 special tokens after the last id) and
  OUT_DIR/hf_pairs/tokenizer.json (the same, merges as ["a", "b"]);
- OUT_DIR/cases.json: [{"text", "pieces": [byte lengths], "tiktoken": ids, "hf": ids}]
  for edge cases and random texts, including 3000 short texts over a tricky alphabet;
- OUT_DIR/corpus.txt (about 2 MB) with OUT_DIR/corpus.tiktoken.json and corpus.hf.json."""
import base64
import json
import os
import random
import sys

import regex

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bpe_reference as gpt2  # noqa: E402  (its text generator and GPT-2's byte stand-ins)

PATTERN_TEXT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PATTERN = regex.compile(PATTERN_TEXT)

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
            "<|reserved_special_token_2|>", "<|reserved_special_token_3|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"] + \
           [f"<|reserved_special_token_{i}|>" for i in range(5, 256 - 5)]


def pieces(text):
    return [p.encode("utf-8") for p in PATTERN.findall(text)]


def train(text, n_merges):
    counts = {}
    for p in pieces(text):
        counts[p] = counts.get(p, 0) + 1
    seqs = {p: [bytes([b]) for b in p] for p in counts}
    merges = []
    for _ in range(n_merges):
        pairs = {}
        for p, c in counts.items():
            s = seqs[p]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + c
        if not pairs:
            break
        best = min(pairs, key=lambda q: (-pairs[q], q))
        merges.append(best)
        for p in seqs:
            seqs[p] = gpt2.merge_pair(seqs[p], best)
    return merges


def merge_leftmost_lowest(parts, rank_of):
    """Merges the leftmost adjacent pair of lowest rank until none has a rank."""
    while len(parts) > 1:
        ranked = [(rank_of(a, b), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        ranked = [r for r in ranked if r[0] is not None]
        if not ranked:
            break
        _, i = min(ranked)
        parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]
    return parts


class Tiktoken:
    def __init__(self, ranks):
        self.ranks = ranks
        self.cache = {}

    def piece(self, p):
        if p not in self.cache:
            if p in self.ranks:
                self.cache[p] = [self.ranks[p]]
            else:
                parts = merge_leftmost_lowest([bytes([b]) for b in p], lambda a, b: self.ranks.get(a + b))
                self.cache[p] = [self.ranks[x] for x in parts]
        return self.cache[p]

    def encode(self, text):
        return [i for p in pieces(text) for i in self.piece(p)]


class HfBpe:
    def __init__(self, vocab, merges):
        self.vocab = vocab  # stand-in spelling -> id
        self.rule = {}
        for r, m in enumerate(merges):
            self.rule.setdefault(m, r)
        self.cache = {}

    def piece(self, p):
        if p not in self.cache:
            word = "".join(gpt2.B2U[b] for b in p)
            if word in self.vocab:  # ignore_merges
                self.cache[p] = [self.vocab[word]]
            else:
                parts = merge_leftmost_lowest(list(word), lambda a, b: self.rule.get((a, b)))
                self.cache[p] = [self.vocab[x] for x in parts]
        return self.cache[p]

    def encode(self, text):
        return [i for p in pieces(text) for i in self.piece(p)]


EDGE = gpt2.EDGE + [
    "IT'S", "We'LL", "they'Re", "I'M", "you'D", "can'T", "'ſ", "x'ſt", "'S'T'RE", "' s", "''", "'1", "'\n",
    "1234567", "12 345 6789", "²³⁴5", "٠١٢٣٤", "x12y", "a1234b", "\r\n", "a\r\n\r\nb", "x\n\n \n  y", "  \n",
    " \n\n ", "\r\r\n x", "abc   ", "abc \t ", "abc\n", "abc\n  ", ".Hello", "!!!\n\n", " !!\n\r\nz", "  !!",
    "\ta", "\u00a0word", "\u3000語", "(hello)", "$100,000.50", "e\u0301t\u00e9 \u0301a", "naïve café", "Ελληνικά",
    "Привет, мир!", "مرحبا بالعالم", "नमस्ते दुनिया", "안녕하세요", "👍🏽👍🏽 ok", "a😀b", "x \u2028\u2029 y",
    "\x1c\x1d a", "tab\t\tend\t", "<|begin_of_text|>Hello", "trailing\n\n\n", " \t \n \t x",
]

TRICKY = ["'", "'", "s", "S", "ſ", "t", "r", "e", "l", "\r", "\n", "\n", " ", " ", " ", "\t", "1", "2", "²", "a",
          "日", ".", "!", "😀", "\u00a0", "\u3000", "\u2028", "\x1c", "\u0301", "-"]


def main(out):
    rng = random.Random(20261128)
    merges = train(gpt2.random_text(rng, 4000) + " ".join(EDGE), 500)
    merged = list(dict.fromkeys(a + b for a, b in merges))  # a merged string may repeat an earlier one
    single = [bytes([b]) for b in range(256)]
    merged = [m for m in merged if len(m) > 1]
    order = list(range(256))
    rng.shuffle(order)
    ranks = {single[b]: r for r, b in enumerate(order)}
    for i, m in enumerate(merged):
        ranks[m] = 256 + i
    with open(os.path.join(out, "tokenizer.model"), "w") as f:
        for tok, r in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(tok).decode()} {r}\n")

    spell = lambda bs: "".join(gpt2.B2U[b] for b in bs)  # noqa: E731
    tokens = [spell(t) for t in single + merged]
    ids = list(range(len(tokens)))
    rng.shuffle(ids)
    vocab = dict(zip(tokens, ids))
    hf_merges = [(spell(a), spell(b)) for a, b in merges]
    for sub, as_pairs in (("hf", False), ("hf_pairs", True)):
        os.makedirs(os.path.join(out, sub), exist_ok=True)
        doc = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [{"id": len(tokens) + i, "content": s, "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True} for i, s in enumerate(SPECIALS)],
            "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": PATTERN_TEXT}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                      "vocab": vocab,
                      "merges": [list(m) if as_pairs else f"{m[0]} {m[1]}" for m in hf_merges]},
        }
        with open(os.path.join(out, sub, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False)

    tik, hf = Tiktoken(ranks), HfBpe(vocab, hf_merges)
    texts = EDGE + [gpt2.random_text(rng, 200) for _ in range(40)]
    texts += ["".join(rng.choice(TRICKY) for _ in range(rng.randint(1, 12))) for _ in range(3000)]
    cases = [{"text": t, "pieces": [len(p) for p in pieces(t)], "tiktoken": tik.encode(t), "hf": hf.encode(t)}
             for t in texts]
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(cases, f)
    corpus = gpt2.random_text(rng, 200000)
    with open(os.path.join(out, "corpus.txt"), "w", encoding="utf-8", newline="") as f:
        f.write(corpus)
    with open(os.path.join(out, "corpus.tiktoken.json"), "w") as f:
        json.dump(tik.encode(corpus), f)
    with open(os.path.join(out, "corpus.hf.json"), "w") as f:
        json.dump(hf.encode(corpus), f)


if __name__ == "__main__":
    main(sys.argv[1])
