#!/usr/bin/env python3
"""Reference for ptrain's GPT-2 tokenizer (data/bpe.hpp), written from GPT-2's published
algorithm with Python's `regex` module (the engine OpenAI's encoder.py uses):

usage: bpe_reference.py OUT_DIR

- trains a small byte-level BPE (300 merges) on generated multilingual text and writes
  it twice: OUT_DIR/hf (vocab.json, non-ASCII kept, + merges.txt) and OUT_DIR/openai
  (encoder.json, \\u escapes, + vocab.bpe); the ids are shuffled, <|endoftext|> is last;
- OUT_DIR/cases.json: [{"text": ..., "ids": [...]}] for edge cases and random texts;
- OUT_DIR/classes.json: {"version": unicode version, "letters"/"numbers"/"spaces":
  [[first, last], ...]} as the regex module classifies every assigned code point
  (Python's unicodedata), to check the C++ tables;
- OUT_DIR/corpus.txt, OUT_DIR/corpus.ids.json: a larger text and its ids."""
import json
import os
import random
import sys
import unicodedata

import regex

PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


B2U = bytes_to_unicode()
U2B = {u: b for b, u in B2U.items()}


def words(text):
    return ["".join(B2U[b] for b in piece.encode("utf-8")) for piece in PATTERN.findall(text)]


def train(text, n_merges):
    counts = {}
    for w in words(text):
        counts[w] = counts.get(w, 0) + 1
    seqs = {w: list(w) for w in counts}
    merges = []
    for _ in range(n_merges):
        pairs = {}
        for w, c in counts.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        for w in seqs:
            seqs[w] = merge_pair(seqs[w], best)
    return merges


def merge_pair(s, pair):
    out, i = [], 0
    while i < len(s):
        if i + 1 < len(s) and (s[i], s[i + 1]) == pair:
            out.append(s[i] + s[i + 1])
            i += 2
        else:
            out.append(s[i])
            i += 1
    return out


def bpe(word, ranks):
    s = list(word)
    while len(s) > 1:
        pairs = [(ranks[p], p) for p in zip(s, s[1:]) if p in ranks]
        if not pairs:
            break
        s = merge_pair(s, min(pairs)[1])
    return s


def encode(text, ranks, vocab):
    return [vocab[t] for w in words(text) for t in bpe(w, ranks)]


ALPHABETS = [
    "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "àéîõüçñßøæ", "абвгдежзийклмнопрстуфхцчшщыэюя",
    "αβγδεζηθικλμνξοπρστυφχψω", "日本語中文字漢", "한국어", "العربية", "हिन्दी", "0123456789", "٠١٢٣", "½²³Ⅻ",
    ".,;:!?-()[]{}\"'/\\@#$%^&*_+=<>|~`", "😀🚀👍🏽", "\u0301\u0308",
]
SPACES = [" ", " ", " ", " ", "  ", "\n", "\n\n", "\t", "\u00a0", "\u3000", "\u2028", "\x1c", " \n", "\r\n"]


WORDS = ["the", "The", "and", "of", "tokenizer", "training", "hello", "world", "2026", "über", "данные", "日本",
         "..."]


def random_text(rng, n_words):
    parts = []
    for _ in range(n_words):
        if rng.random() < 0.4:  # frequent words: merges of merges
            parts.append(rng.choice(WORDS))
        else:
            a = rng.choice(ALPHABETS[:6] if rng.random() < 0.7 else ALPHABETS)
            parts.append("".join(rng.choice(a) for _ in range(rng.randint(1, 8))))
        if rng.random() < 0.1:
            parts.append(rng.choice(["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'x"]))
        parts.append(rng.choice(SPACES))
    return "".join(parts)


EDGE = [
    "", " ", "  ", "   ", "a", " a", "  a", "a ", "a  ", "\n", "\n\n\nx", " \n x", "x\n\n", "it's", "IT'S", "don't",
    "we'll they've I'm you'd", "x'", "'", "''s", " 's", "!'s", "12345 678", " 1x2", "a1b2", "hello  world", "\t\tx",
    "tab\tsep", "e\u0301t\u00e9", "日本語のテキスト", "Ⅻ ½ ²", "😀 🚀🚀", "\u00a0a\u00a0 a", "x\u3000\u3000y", "a\x1cb",
    "\u2028\u2029z", " \u200b ", "<|endoftext|>", "The quick brown fox jumps over the lazy dog.",
]


def ranges_of(pred):
    out, start = [], None
    for cp in range(0x110000):
        inside = unicodedata.category(chr(cp)) != "Cn" and pred(chr(cp))
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            out.append([start, cp - 1])
            start = None
    if start is not None:
        out.append([start, 0x10FFFF])
    return out


def main_to(out, classes=True):
    rng = random.Random(20261125)
    merges = train(random_text(rng, 4000) + " ".join(EDGE), 300)
    tokens = [B2U[b] for b in range(256)] + [a + b for a, b in merges]
    tokens = list(dict.fromkeys(tokens))  # a merged string may repeat an earlier token
    ids = list(range(len(tokens)))
    rng.shuffle(ids)
    vocab = dict(zip(tokens, ids))
    vocab["<|endoftext|>"] = len(tokens)
    ranks = {m: i for i, m in enumerate(merges)}
    for sub, vname, mname, ascii_only in (("hf", "vocab.json", "merges.txt", False),
                                          ("openai", "encoder.json", "vocab.bpe", True)):
        os.makedirs(os.path.join(out, sub), exist_ok=True)
        with open(os.path.join(out, sub, vname), "w", encoding="utf-8") as f:
            json.dump(vocab, f, ensure_ascii=ascii_only)
        with open(os.path.join(out, sub, mname), "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    cases = [{"text": t, "ids": encode(t, ranks, vocab)} for t in EDGE]
    cases += [{"text": t, "ids": encode(t, ranks, vocab)} for t in (random_text(rng, 200) for _ in range(40))]
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(cases, f)
    if classes:
        table = {
            "version": unicodedata.unidata_version,
            "letters": ranges_of(lambda c: regex.match(r"\p{L}", c) is not None),
            "numbers": ranges_of(lambda c: regex.match(r"\p{N}", c) is not None),
            "spaces": ranges_of(lambda c: regex.match(r"\s", c) is not None),
        }
        with open(os.path.join(out, "classes.json"), "w") as f:
            json.dump(table, f)
    corpus = random_text(rng, 30000)
    with open(os.path.join(out, "corpus.txt"), "w", encoding="utf-8", newline="") as f:
        f.write(corpus)
    with open(os.path.join(out, "corpus.ids.json"), "w") as f:
        json.dump(encode(corpus, ranks, vocab), f)


if __name__ == "__main__":
    main_to(sys.argv[1])
