"""Tiny generated corpora for the data tests."""
import json
import os
import random

from ttt_lm.data.config import DataConfig

WORDS = ("the quick brown fox jumps over a lazy dog and then the cat sat on my mat while seven "
         "old kings sang loud songs of war peace love wine bread fire water stone").split()

VOCAB = 300          # the smallest SentencePiece accepts here: 3 specials + 256 bytes + characters
SEQ_LEN = 16
SHARD_TOKENS = 400


def make_texts(n_docs: int, seed: int = 0, min_words: int = 24, max_words: int = 80):
    rng = random.Random(seed)
    texts = []
    for i in range(n_docs):
        lines = []
        for _ in range(rng.randint(min_words, max_words) // 8):
            lines.append(" ".join(rng.choice(WORDS) for _ in range(8)))
        texts.append(f"Doc {i}.\n" + "\n".join(lines) + "\n")
    return texts


def write_corpus(root, texts, jsonl_from: int = None):
    """The first texts as .txt files, the rest (from ``jsonl_from``) as lines of one .jsonl."""
    os.makedirs(root, exist_ok=True)
    jsonl_from = len(texts) if jsonl_from is None else jsonl_from
    for i, t in enumerate(texts[:jsonl_from]):
        with open(os.path.join(root, f"a{i:03d}.txt"), "w", encoding="utf-8") as f:
            f.write(t)
    if jsonl_from < len(texts):
        with open(os.path.join(root, "b.jsonl"), "w", encoding="utf-8") as f:
            for t in texts[jsonl_from:]:
                f.write(json.dumps({"text": t}) + "\n")
    return root


def data_cfg(path, **kw) -> DataConfig:
    kw.setdefault("seq_len", SEQ_LEN)
    return DataConfig(path=path, **kw)
