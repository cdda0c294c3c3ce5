import dataclasses
import gzip
import itertools
import json
import logging
import os
import shutil
import tarfile

import pytest

from tests.data.corpus import SEQ_LEN, VOCAB, data_cfg, make_texts, write_corpus
from ttt_lm.data import DataError, build_train_loader, build_val_loader, check_vocab, iter_documents, load_manifest
from ttt_lm.data.prepare import prepare
from ttt_lm.data.loader import iter_stream
from ttt_lm.data.shards import read_shard
from ttt_lm.data.sources import InputError, SourceStats, read_documents

B = 4


@pytest.fixture
def copy(prepared, tmp_path):
    """A private copy of the prepared corpus to damage."""
    dst = str(tmp_path / "data")
    shutil.copytree(prepared[0], dst)
    return dst, load_manifest(dst)


def _first_payload(path) -> int:
    with tarfile.open(path) as t:
        return t.getmembers()[0].offset_data


def _patch(path, offset, data: bytes):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_truncated_shard_is_named(copy):
    path, man = copy
    name = man["splits"]["train"]["shards"][3]["name"]
    with open(os.path.join(path, name), "r+b") as f:
        f.truncate(700)
    with pytest.raises(DataError, match=f"{name} is 700 bytes.*truncated"):
        build_train_loader(data_cfg(path), B)
    # a shard truncated after startup is caught when it is read
    with pytest.raises(DataError, match="truncated"):
        read_shard(path, man["splits"]["train"]["shards"][3], VOCAB, man["dtype"])


def test_broken_tar_structure_is_an_error_not_a_hang(copy):
    path, man = copy
    for s in man["splits"]["train"]["shards"]:
        _patch(os.path.join(path, s["name"]), 0, b"\x7f" * 512)  # garbage tar header, same size
    man = _reseal(path, man)  # written that way (digests match): the tar parser must still refuse it
    with pytest.raises(DataError, match="corrupt and cannot be read as a tar file"):
        read_shard(path, man["splits"]["train"]["shards"][0], VOCAB, man["dtype"])
    # raised inside a DataLoader worker, it reaches the training loop
    loader = build_train_loader(data_cfg(path, num_workers=2), B)
    with pytest.raises(DataError, match="corrupt"):
        list(itertools.islice(iter(loader), 4))


def _multi_doc_shard(man):
    return next(s for s in man["splits"]["train"]["shards"] if s["documents"] >= 2)


def _reseal(path, man):
    """Record the shards' current digests in the manifest, as if they had been written that way."""
    from ttt_lm.data.manifest import MANIFEST, manifest_checksum
    from ttt_lm.data.tokenizer import sha256_file
    with open(os.path.join(path, MANIFEST)) as f:
        raw = json.load(f)
    for split in raw["splits"].values():
        for s in split["shards"]:
            s["sha256"] = sha256_file(os.path.join(path, s["name"]))
    raw["checksum"] = manifest_checksum(raw["tokenizer_sha256"], raw["splits"])
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(raw, f)
    return load_manifest(path)


def test_flipped_byte_in_a_member_header_stops_naming_the_shard(copy):
    """tarfile reads a damaged header after the first as the end of the archive: the rest of the
    shard would vanish without a word. The digest catches it; without the digest, the counts do."""
    path, man = copy
    shard = max(man["splits"]["train"]["shards"], key=lambda s: s["documents"])
    f = os.path.join(path, shard["name"])
    with tarfile.open(f) as t:
        second = t.getmembers()[1].offset  # header of the second document (one member per document)
    with open(f, "rb") as fh:
        fh.seek(second + 10)
        b = fh.read(1)
    _patch(f, second + 10, bytes([b[0] ^ 0x01]))
    with pytest.raises(DataError, match=f"{shard['name']}: sha256 differs from the manifest"):
        read_shard(path, shard, VOCAB, man["dtype"])
    with pytest.raises(DataError, match=rf"{shard['name']}: read 1 document\(s\), the manifest says "
                                        rf"{shard['documents']}"):
        read_shard(path, shard, VOCAB, man["dtype"], verify_sha256=False)
    # the loader (and so training) stops on it too, with the same message
    with pytest.raises(DataError, match=f"{shard['name']}: sha256 differs"):
        list(itertools.islice(iter(build_train_loader(data_cfg(path, shuffle=False), B)), 1000))


def test_flipped_byte_in_token_data_stops_naming_the_shard(copy):
    path, man = copy
    shard = _multi_doc_shard(man)
    f = os.path.join(path, shard["name"])
    off = _first_payload(f) + 130  # inside the first document's uint16 tokens, after the npy header
    with open(f, "rb") as fh:
        fh.seek(off)
        b = fh.read(1)
    _patch(f, off, bytes([b[0] ^ 0x01]))  # a valid token id still: only the digest can tell
    with pytest.raises(DataError, match=f"{shard['name']}: sha256 differs from the manifest"):
        read_shard(path, shard, VOCAB, man["dtype"])


def test_manifest_counts_are_checked(copy):
    path, man = copy
    shard = dict(_multi_doc_shard(man))
    with pytest.raises(DataError, match=rf"read {shard['tokens']} tokens, the manifest says {shard['tokens'] + 1}"):
        read_shard(path, dict(shard, tokens=shard["tokens"] + 1), VOCAB, man["dtype"])


def test_corrupt_sample_is_skipped_and_counted(copy, caplog):
    path, man = copy
    shard = _multi_doc_shard(man)
    f = os.path.join(path, shard["name"])
    _patch(f, _first_payload(f), b"garbage!")  # the npy magic of the first document
    # damaged after it was written: the digest stops it
    with pytest.raises(DataError, match=f"{shard['name']}: sha256 differs"):
        read_shard(path, shard, VOCAB, man["dtype"])
    # written damaged (the digest matches): the sample is skipped, counted and logged
    man = _reseal(path, man)
    shard = next(s for s in man["splits"]["train"]["shards"] if s["name"] == shard["name"])
    with caplog.at_level(logging.WARNING):
        docs, skipped = read_shard(path, shard, VOCAB, man["dtype"])
    assert skipped == 1 and len(docs) == shard["documents"] - 1
    assert "skipped 1 corrupt sample(s)" in caplog.text and shard["name"] in caplog.text
    assert len(list(iter_documents(path, "train"))) == man["splits"]["train"]["documents"] - 1
    # the loader reads past it, and deterministically: two loaders agree
    a, b = (list(itertools.islice(iter(build_train_loader(data_cfg(path), B)), 40)) for _ in range(2))
    assert all((x["input_ids"] == y["input_ids"]).all() for x, y in zip(a, b))


def test_startup_checksum_pass_names_the_shard(copy):
    path, man = copy
    shard = _multi_doc_shard(man)
    _patch(os.path.join(path, shard["name"]), _first_payload(os.path.join(path, shard["name"])), b"garbage!")
    # same size: only a digest notices; verify_checksums hashes every shard before the first batch
    with pytest.raises(DataError, match=f"{shard['name']}: sha256 differs"):
        build_train_loader(data_cfg(path, verify_checksums=True), B)


def test_token_ids_outside_the_vocabulary_are_corrupt(copy, caplog):
    path, man = copy
    shard = _multi_doc_shard(man)
    f = os.path.join(path, shard["name"])
    # the npy v1 header of a small 1-D array is 128 bytes; the first uint16 token follows it
    _patch(f, _first_payload(f) + 128, b"\xff\xff")
    man = _reseal(path, man)
    shard = next(s for s in man["splits"]["train"]["shards"] if s["name"] == shard["name"])
    with caplog.at_level(logging.WARNING):
        docs, skipped = read_shard(path, shard, VOCAB, man["dtype"])
    assert skipped == 1 and "token id 65535 >= vocab_size 300" in caplog.text


def test_empty_input_files_are_skipped_and_listed(tmp_path, caplog):
    raw = write_corpus(str(tmp_path / "raw"), make_texts(6, seed=4))
    open(os.path.join(raw, "a999.txt"), "w").close()
    open(os.path.join(raw, "blank.jsonl"), "w").write("\n  \n")
    with caplog.at_level(logging.WARNING):
        man = prepare([raw], str(tmp_path / "out"), vocab_size=VOCAB, shard_tokens=300, val_fraction=0.2,
                      workers=1, progress=False)
    assert man["documents"] == 6
    assert sorted(os.path.basename(f) for f in man["source"]["stats"]["empty_files"]) == ["a999.txt", "blank.jsonl"]
    assert "a999.txt holds no text" in caplog.text


def test_only_empty_inputs_is_an_error(tmp_path):
    d = tmp_path / "raw"
    d.mkdir()
    (d / "x.txt").write_text("")
    (d / "y.txt").write_text("\n\n")
    with pytest.raises(DataError, match="no documents found in 2 input file"):
        prepare([str(d)], str(tmp_path / "out"), vocab_size=VOCAB, workers=1, progress=False)


def test_one_document_cannot_be_split(tmp_path):
    d = tmp_path / "raw"
    d.mkdir()
    (d / "x.txt").write_text(make_texts(1)[0])
    with pytest.raises(DataError, match="at least 2 are needed"):
        prepare([str(d)], str(tmp_path / "out"), vocab_size=VOCAB, workers=1, progress=False)


def test_non_utf8_bytes_are_replaced_and_counted(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 and \xff\xfe bytes, a real \xef\xbf\xbd stays")
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "ok \xc3\x28 x"}\n{"text": "fine"}\n')
    stats = SourceStats()
    docs = [t for _, t in read_documents([str(tmp_path)], stats=stats)]
    assert docs[0] == "caf\ufffd and \ufffd\ufffd bytes, a real \ufffd stays"
    assert docs[1] == "ok \ufffd( x" and docs[2] == "fine"
    assert stats.non_utf8_documents == 2 and stats.replacement_chars == 4


def test_bad_jsonl_and_bad_archives_name_the_file(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(InputError, match=r"a.jsonl:2: not valid JSON"):
        list(read_documents([str(tmp_path / "a.jsonl")]))
    (tmp_path / "b.jsonl").write_text('{"content": "x"}\n')
    with pytest.raises(InputError, match=r"b.jsonl:1: no field 'text'.*--text-field"):
        list(read_documents([str(tmp_path / "b.jsonl")]))
    good = gzip.compress(json.dumps({"text": "x" * 5000}).encode())
    (tmp_path / "c.jsonl.gz").write_bytes(good[: len(good) // 2])
    with pytest.raises(InputError, match="c.jsonl.gz: cannot be read"):
        list(read_documents([str(tmp_path / "c.jsonl.gz")]))
    with pytest.raises(InputError, match="does not exist"):
        list(read_documents([str(tmp_path / "nope")]))


def test_vocab_mismatch(prepared):
    man = load_manifest(prepared[0])
    check_vocab(man, VOCAB)
    check_vocab(man, 320, allow_padding=True)
    with pytest.raises(DataError, match="model has vocab_size=4096 .* 300-token tokenizer"):
        check_vocab(man, 4096)
    with pytest.raises(DataError, match="vocab_size=256"):
        check_vocab(man, 256, allow_padding=True)


def test_directory_without_shards(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no prepared data .*manifest.json does not exist"):
        build_train_loader(data_cfg(str(empty)), B)
    (empty / "train-000000.tar").write_bytes(b"")
    with pytest.raises(DataError, match="holds .tar files but no manifest"):
        load_manifest(str(empty))
    (empty / "manifest.json").write_text("")
    with pytest.raises(DataError, match="is empty"):
        load_manifest(str(empty))


def test_manifest_without_train_shards_or_with_missing_files(copy):
    path, man = copy
    raw = json.load(open(os.path.join(path, "manifest.json")))
    os.remove(os.path.join(path, man["splits"]["train"]["shards"][1]["name"]))
    with pytest.raises(DataError, match="shard train-000001.tar is missing"):
        load_manifest(path)
    raw["splits"]["train"]["shards"] = []
    json.dump(raw, open(os.path.join(path, "manifest.json"), "w"))
    with pytest.raises(DataError, match="lists no train shards"):
        load_manifest(path)


def test_fewer_shards_than_streams(prepared):
    n = len(prepared[1]["splits"]["train"]["shards"])
    with pytest.raises(DataError, match=rf"has {n} train shard\(s\), fewer than the 32 data streams"):
        build_train_loader(data_cfg(prepared[0], num_workers=8, streams=32), B, 0, 4)
    # the default never asks for more streams than there are shards, on any number of ranks × workers
    assert build_train_loader(data_cfg(prepared[0], num_workers=8), B, 0, 4).total_streams == min(8, n)


def test_sequences_longer_than_any_shard(prepared):
    with pytest.raises(DataError, match="fewer than seq_len\\+1"):
        build_train_loader(data_cfg(prepared[0], seq_len=10_000), B)
    with pytest.raises(DataError, match="too few for one sequence"):
        len(build_val_loader(data_cfg(prepared[0], seq_len=SEQ_LEN * 1000), B))


def test_a_stream_without_any_full_sequence_is_an_error_not_a_hang(prepared):
    shards = prepared[1]["splits"]["train"]["shards"]
    plan = build_train_loader(data_cfg(prepared[0]), B).plan
    # one shard per stream and sequences only the largest shard can hold
    plan = dataclasses.replace(plan, n_streams=len(shards), seq_len=max(s["tokens"] for s in shards) - 1)
    errors = 0
    for stream in range(plan.n_streams):
        try:
            next(iter_stream(plan, stream, (0, 0, 0)))
        except DataError as e:
            assert "hold no sequence of seq_len+1" in str(e)
            errors += 1
    assert 0 < errors < len(shards)
