#!/usr/bin/env python3
"""Reference for ptrain's SentencePiece wrapper (data/sentencepiece.hpp): Google's Python
package (Debian: python3-sentencepiece) trains two small models on generated text and
encodes texts with them.

usage: sentencepiece_reference.py OUT_DIR

- OUT_DIR/bpe.model: BPE with Llama 2's options (byte fallback, digits split one by one,
  no normalization, a dummy prefix); OUT_DIR/unigram.model: unigram with the default
  normalizer (NFKC);
- OUT_DIR/cases.json: {"bpe"|"unigram": {"bos", "eos", "size", "cases": [{"text", "ids"}]}}
  for edge cases and random texts, and the pieces "<s>", "</s>", "<unk>" with their ids;
- OUT_DIR/corpus.txt with OUT_DIR/corpus.bpe.json and corpus.unigram.json."""
import json
import os
import random
import sys

import sentencepiece as spm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bpe_reference as gpt2  # noqa: E402  (its text generator and edge cases)


def main(out):
    rng = random.Random(20261129)
    train_path = os.path.join(out, "train.txt")
    with open(train_path, "w", encoding="utf-8") as f:
        for _ in range(3000):
            f.write(gpt2.random_text(rng, 20).replace("\n", " ").replace("\r", " ").replace("\u2028", " ") + "\n")
    common = dict(input=train_path, vocab_size=600, character_coverage=1.0, num_threads=1, minloglevel=2,
                  bos_id=1, eos_id=2, unk_id=0)
    spm.SentencePieceTrainer.train(model_prefix=os.path.join(out, "bpe"), model_type="bpe", byte_fallback=True,
                                   split_digits=True, normalization_rule_name="identity",
                                   allow_whitespace_only_pieces=True, remove_extra_whitespaces=False, **common)
    spm.SentencePieceTrainer.train(model_prefix=os.path.join(out, "unigram"), model_type="unigram", **common)
    texts = gpt2.EDGE + ["Hello world", "  leading and trailing  ", "12345", "ｆｕｌｌ ｗｉｄｔｈ ①", "a\u0000b",
                         "unknown: \U0001F9E0 \u16A0"]
    texts += [gpt2.random_text(rng, 100) for _ in range(40)]
    corpus = gpt2.random_text(rng, 100000)
    with open(os.path.join(out, "corpus.txt"), "w", encoding="utf-8", newline="") as f:
        f.write(corpus)
    result = {}
    for kind in ("bpe", "unigram"):
        sp = spm.SentencePieceProcessor(model_file=os.path.join(out, kind + ".model"))
        result[kind] = {"bos": sp.bos_id(), "eos": sp.eos_id(), "size": sp.get_piece_size(),
                        "cases": [{"text": t, "ids": sp.encode(t), "decoded": sp.decode(sp.encode(t))}
                                  for t in texts]}
        with open(os.path.join(out, f"corpus.{kind}.json"), "w") as f:
            json.dump(sp.encode(corpus), f)
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
