import gzip
import json
import math
import os

import numpy as np
import pytest
import zstandard

from ttt_lm.data import iter_documents, load_manifest, load_tokenizer, verify_checksums
from ttt_lm.data.default_corpus import prepare_corpus, shakespeare_files
from ttt_lm.data.manifest import DataError
from ttt_lm.data.prepare import is_val_document, main, prepare
from ttt_lm.data.shards import token_dtype
from ttt_lm.data.sources import SourceStats, read_documents

from tests.data.corpus import SHARD_TOKENS, VOCAB, make_texts, write_corpus


def test_manifest_describes_the_directory(prepared, corpus_texts):
    out, man = prepared
    m = load_manifest(out)
    assert m["vocab_size"] == VOCAB and m["dtype"] == "uint16" and m["eos_id"] == 2
    assert m["documents"] == len(corpus_texts) == 40
    train, val = m["splits"]["train"], m["splits"]["val"]
    assert val["documents"] == math.ceil(40 * 0.05) == 2
    assert train["documents"] + val["documents"] == 40
    assert train["tokens"] + val["tokens"] == m["tokens"]
    assert len(train["shards"]) >= 8
    for s in train["shards"]:
        assert os.path.getsize(os.path.join(out, s["name"])) == s["bytes"]
        # a shard closes before the document that would pass the target, unless it is its only one
        assert s["tokens"] <= SHARD_TOKENS or s["documents"] == 1
    assert os.path.isfile(m["tokenizer_path"])
    verify_checksums(m)


def test_shards_round_trip_to_the_input_text(prepared, corpus_texts):
    out, man = prepared
    tok = load_tokenizer(out)
    seen = {}
    for split in ("train", "val"):
        for doc_id, ids in iter_documents(out, split, with_ids=True):
            assert int(ids[-1]) == tok.eos_id and (ids[:-1] != tok.eos_id).all()
            seen[doc_id] = tok.decode(ids[:-1].tolist())
    assert seen == dict(enumerate(corpus_texts))
    val_ids = [d for d, _ in iter_documents(out, "val", with_ids=True)]
    assert val_ids == [i for i in range(40) if is_val_document(i, 0.05)] == [0, 20]


def test_tokenizer_byte_fallback_represents_anything(prepared):
    tok = load_tokenizer(prepared[0])
    s = "Unseen: héllo 世界 🙂\t\r\n  two  spaces\x00"
    ids = tok.encode(s)
    assert tok.unk_id not in ids
    assert tok.decode(ids) == s
    assert tok.encode("x", add_eos=True)[-1] == tok.eos_id and tok.vocab_size == VOCAB


def test_uint32_when_the_vocabulary_does_not_fit_uint16():
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_all_input_formats_and_text_field(tmp_path):
    texts = make_texts(6, seed=3)
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    (d / "one.txt").write_text(texts[0])
    (d / "sub" / "two.jsonl").write_text(json.dumps({"body": texts[1]}) + "\n\n" + json.dumps({"body": texts[2]}) + "\n")
    with gzip.open(d / "three.jsonl.gz", "wt") as f:
        f.write(json.dumps({"body": texts[3]}) + "\n")
    (d / "four.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        (json.dumps({"body": texts[4]}) + "\n" + json.dumps({"body": texts[5]}) + "\n").encode()))
    (d / "ignored.csv").write_text("not read")
    stats = SourceStats()
    got = [t for _, t in read_documents([str(d)], text_field="body", stats=stats)]
    # sorted paths: four.jsonl.zst, one.txt, sub/two.jsonl, three.jsonl.gz
    assert got == [texts[4], texts[5], texts[0], texts[1], texts[2], texts[3]]
    assert stats.files == 4 and stats.documents == 6


def test_parallel_tokenization_is_deterministic_and_tokenizer_reuse(tmp_path, prepared, corpus_texts):
    raw = write_corpus(str(tmp_path / "raw"), corpus_texts, jsonl_from=30)
    out2 = str(tmp_path / "p2")
    man2 = prepare([raw], out2, tokenizer=prepared[1]["root"], shard_tokens=SHARD_TOKENS, val_fraction=0.05,
                   workers=2, progress=False)
    assert man2["tokenizer_type"] == "given"
    assert man2["tokenizer_sha256"] == prepared[1]["tokenizer_sha256"]
    # same tokenizer, same inputs, 2 processes instead of 1: byte-identical shards
    assert man2["checksum"] == prepared[1]["checksum"]


def test_cli(tmp_path):
    raw = write_corpus(str(tmp_path / "raw"), make_texts(8, seed=1))
    out = str(tmp_path / "out")
    args = ["--input", raw, "--output", out, "--vocab-size", "300", "--model-type", "unigram",
            "--shard-tokens", "500", "--val-fraction", "0.2", "--workers", "1", "--no-progress"]
    assert main(args) == 0
    man = load_manifest(out)
    assert man["tokenizer_type"] == "unigram" and man["vocab_size"] == 300
    assert man["splits"]["val"]["documents"] == 2
    assert main(args) == 2  # refuses to overwrite prepared data (refused input: 2)
    assert main(args + ["--overwrite"]) == 0


def test_default_corpus_files_are_installed():
    files = shakespeare_files()
    assert len(files) == 42 and all(f.endswith("_gut.txt") for f in files)
    assert 4_000_000 < sum(os.path.getsize(f) for f in files) < 6_000_000


def test_default_corpus_preparation_is_idempotent(tmp_path):
    files = [str(p) for p in [tmp_path / f"play{i}.txt" for i in range(6)]]
    for f, t in zip(files, make_texts(6, seed=2)):
        open(f, "w").write(t)
    out = str(tmp_path / "out")
    kw = dict(vocab_size=VOCAB, shard_tokens=400, val_fraction=0.2, workers=1, progress=False)
    assert prepare_corpus(files, out, **kw) is True
    first = load_manifest(out)["checksum"]
    assert prepare_corpus(files, out, **kw) is False
    shard = os.path.join(out, load_manifest(out)["splits"]["train"]["shards"][0]["name"])
    raw = bytearray(open(shard, "rb").read())
    raw[700] ^= 0xFF  # damaged but same size: only the checksum notices
    open(shard, "wb").write(bytes(raw))
    with pytest.raises(DataError, match="sha256"):
        verify_checksums(load_manifest(out))
    assert prepare_corpus(files, out, **kw) is True
    assert load_manifest(out)["checksum"] == first


def test_prepare_never_deletes_what_it_did_not_write(tmp_path):
    raw = write_corpus(str(tmp_path / "raw"), make_texts(8, seed=1))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "old.tar").write_text("mine too")
    args = ["--input", raw, "--output", str(out), "--vocab-size", "300", "--shard-tokens", "500",
            "--val-fraction", "0.2", "--workers", "1", "--no-progress"]
    # a non-empty directory that is not a prepared one is refused, with or without --overwrite
    for extra in ([], ["--overwrite"]):
        with pytest.raises(DataError, match=r"--output .*out is not empty and is not a prepared data directory.*"
                                            r"notes.txt, old.tar"):
            prepare([raw], str(out), vocab_size=300, shard_tokens=500, workers=1, progress=False,
                    overwrite=bool(extra))
        assert main(args + extra) == 2
    assert sorted(os.listdir(out)) == ["notes.txt", "old.tar"]
    # into a prepared directory (with --overwrite) it replaces its own files and keeps the others
    out2 = tmp_path / "out2"
    assert main(["--input", raw, "--output", str(out2)] + args[4:]) == 0
    (out2 / "notes.txt").write_text("mine")
    (out2 / "old.tar").write_text("mine too")
    assert main(["--input", raw, "--output", str(out2)] + args[4:] + ["--overwrite"]) == 0
    assert (out2 / "notes.txt").read_text() == "mine" and (out2 / "old.tar").read_text() == "mine too"
    assert not (out2 / ".prepare-incomplete").exists()
    load_manifest(str(out2))


def test_unfinished_preparation_is_resumed_without_overwrite(tmp_path):
    raw = write_corpus(str(tmp_path / "raw"), make_texts(8, seed=1))
    out = tmp_path / "out"
    out.mkdir()
    (out / ".prepare-incomplete").write_text("")
    (out / "train-000000.tar.tmp").write_bytes(b"partial")
    prepare([raw], str(out), vocab_size=300, shard_tokens=500, val_fraction=0.2, workers=1, progress=False)
    assert not (out / "train-000000.tar.tmp").exists() and load_manifest(str(out))["vocab_size"] == 300


def test_missing_data_hint_names_the_directory_itself(tmp_path):
    d = tmp_path / "data" / "mycorpus"
    with pytest.raises(DataError, match=rf"--output {d}`"):
        load_manifest(str(d))


def test_too_small_vocabulary_is_named(tmp_path):
    """Not "no documents found … all were empty" on a corpus of non-empty files."""
    raw = write_corpus(str(tmp_path / "raw"), make_texts(8, seed=1))
    with pytest.raises(DataError, match=r"--vocab-size 256: vocab_size 256 is too small: byte fallback .* "
                                        r"use at least 300"):
        prepare([raw], str(tmp_path / "out"), vocab_size=256, workers=1, progress=False)
