"""Prepared corpora read over HTTP and through ``pipe:`` commands (ttt_lm.data.remote)."""
import functools
import http.server
import json
import os
import shutil
import socket
import itertools
import threading

import numpy as np
import pytest
import torch

from tests.data.corpus import data_cfg
from tests.data.test_loader import B, take
from ttt_lm.data import (DataError, build_train_loader, build_val_loader, iter_documents, load_manifest,
                         load_tokenizer, verify_checksums)
from ttt_lm.data.prepare import prepare
from ttt_lm.data.remote import is_remote, locate
from ttt_lm.data.shards import read_shard


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def serve():
    """``serve(directory)`` -> base URL of a ThreadingHTTPServer on 127.0.0.1 (a free port) serving it."""
    servers = []

    def start(directory):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=directory))
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TTT_LM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


def test_forms_of_data_path():
    assert is_remote("http://127.0.0.1:8000/c") and is_remote("https://h/c/") and is_remote("pipe:cat {file}")
    assert is_remote("gs://bucket/c")
    assert not is_remote("data/shakespeare") and not is_remote("/abs/dir") and not is_remote("file:///x")
    assert locate("https://h/c/", "train-000000.tar") == "https://h/c/train-000000.tar"
    assert locate("pipe:aws s3 cp s3://b/c/{file} -", "manifest.json") == "pipe:aws s3 cp s3://b/c/manifest.json -"


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_http_batches_equal_local_and_resume_exactly(prepared, serve, num_workers, cache):
    out, man = prepared
    url = serve(out)
    cfg, local = data_cfg(url, num_workers=num_workers), data_cfg(out, num_workers=num_workers)
    remote_man = load_manifest(url)
    assert remote_man["root"] == url and remote_man["checksum"] == man["checksum"]
    # the tokenizer is a verified copy in the cache
    assert remote_man["tokenizer_path"].startswith(str(cache))
    assert load_tokenizer(remote_man["tokenizer_path"]).vocab_size == man["vocab_size"]
    k, more = 7, 45
    uninterrupted = build_train_loader(cfg, 4 * B, 0, 1)
    ref = take(uninterrupted, k + more)
    _same(ref, take(build_train_loader(local, 4 * B, 0, 1), k + more))
    assert all(epoch >= 1 for epoch, _, _, _ in uninterrupted.state_dict()["streams"])  # crossed an epoch
    loader = build_train_loader(cfg, 4 * B, 0, 1)
    first = take(loader, k)
    sd = json.loads(json.dumps(loader.state_dict()))
    resumed = build_train_loader(cfg, 4 * B, 0, 1)
    resumed.load_state_dict(sd)
    _same(first + take(resumed, more), ref)
    # a local copy of the same data resumes the remote run's state (same manifest checksum)
    again = build_train_loader(local, 4 * B, 0, 1)
    again.load_state_dict(sd)
    _same(first + take(again, more), ref)


def test_http_manifest_url_val_documents_and_checksums(prepared, serve):
    out, _ = prepared
    url = serve(out)
    for path in (url, url + "/", url + "/manifest.json"):
        assert load_manifest(path)["root"] == url
    _same(list(build_val_loader(data_cfg(url), B)), list(build_val_loader(data_cfg(out), B)))
    docs = list(iter_documents(url, "train", with_ids=True))
    assert [d for d, _ in docs] == [d for d, _ in iter_documents(out, "train", with_ids=True)]
    verify_checksums(load_manifest(url))
    build_train_loader(data_cfg(url, verify_checksums=True), B)


def test_pipe_command_reads_the_corpus(prepared):
    out, _ = prepared
    cmd = f"pipe:cat {out}/{{file}}"
    _same(take(build_train_loader(data_cfg(cmd), B), 10), take(build_train_loader(data_cfg(out), B), 10))
    # in order the shards stream; the loader stops inside one, and the command is left behind cleanly
    in_order = [data_cfg(p, shuffle=False) for p in (cmd, out)]
    _same(take(build_train_loader(in_order[0], B), 10), take(build_train_loader(in_order[1], B), 10))
    _same(list(build_val_loader(data_cfg(cmd), B)), list(build_val_loader(data_cfg(out), B)))
    verify_checksums(load_manifest(cmd))


def test_pipe_command_needs_the_placeholder(prepared):
    with pytest.raises(DataError, match=r"must contain \{file\}"):
        load_manifest(f"pipe:cat {prepared[0]}/manifest.json")


def _one_line(e):
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_missing_url_and_refused_connection_name_the_url(prepared, serve):
    url = serve(prepared[0]) + "/no-such-corpus"
    with pytest.raises(DataError) as e:
        load_manifest(url)
    msg = _one_line(e)
    assert f"{url}/manifest.json" in msg and "HTTP error" in msg
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = f"http://127.0.0.1:{port}/corpus"
    with pytest.raises(DataError) as e:
        load_manifest(dead)
    msg = _one_line(e)
    assert f"{dead}/manifest.json" in msg and "could not connect" in msg


def test_failing_pipe_command_names_it(tmp_path):
    with pytest.raises(DataError) as e:
        load_manifest(f"pipe:cat {tmp_path}/nothing/{{file}}")
    msg = _one_line(e)
    assert f"pipe:cat {tmp_path}/nothing/manifest.json" in msg and "exited with status 1" in msg


def test_a_corrupt_or_missing_remote_shard_is_named_when_read(prepared, serve, tmp_path):
    out, man = prepared
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    name = man["splits"]["train"]["shards"][0]["name"]
    raw = bytearray((bad / name).read_bytes())
    raw[700] ^= 0x01  # same size, one bit flipped
    (bad / name).write_bytes(bytes(raw))
    url = serve(str(bad))
    cfg = data_cfg(url, shuffle=False)
    # read in order, the shard's windows stream in as it arrives and its digest is checked at its end
    loader = iter(build_train_loader(cfg, 1))
    first = next(loader)
    assert int(first["doc_ids"][0, 0]) == int(min(d for d, _ in iter_documents(out, "train", with_ids=True)))
    with pytest.raises(DataError, match=f"shard {url}/{name}: sha256 differs"):
        take(loader, 1000)
    # collected whole (a shuffled shard, the evals), nothing of it is returned
    with pytest.raises(DataError, match=f"shard {url}/{name}: sha256 differs"):
        read_shard(url, man["splits"]["train"]["shards"][0], man["vocab_size"], man["dtype"])
    with pytest.raises(DataError, match=f"shard {url}/{name}: sha256 differs"):
        build_train_loader(data_cfg(url, verify_checksums=True), B)
    os.remove(bad / name)
    with pytest.raises(DataError, match=f"cannot read {url}/{name}: curl exit 22"):
        take(build_train_loader(cfg, B), 1)


def test_a_tokenizer_that_differs_from_the_manifest_is_refused(prepared, serve, tmp_path):
    out, man = prepared
    bad = tmp_path / "tok"
    shutil.copytree(out, bad)
    with open(bad / man["tokenizer"], "ab") as f:
        f.write(b"x")
    url = serve(str(bad))
    with pytest.raises(DataError, match=f"{url}/{man['tokenizer']}: sha256 .* differs from the manifest"):
        load_manifest(url)


def test_a_hugging_face_tokenizer_comes_with_its_config(tmp_path, cache):
    """A tokenizer.json whose end-of-document token only its tokenizer_config.json names: the
    cached copy gets the config beside it and reads the same eos id."""
    from tests.data.test_prepare_hf import TEXTS, _bpe
    bare = _bpe(str(tmp_path / "bare.json"), special=("[SEP]", "[PAD]"))
    with open(tmp_path / "docs.jsonl", "w") as f:
        for t in TEXTS:
            f.write(json.dumps({"text": t}) + "\n")
    out = str(tmp_path / "out")
    man = prepare([str(tmp_path / "docs.jsonl")], out, tokenizer=bare, eos_token="[SEP]", val_fraction=0,
                  workers=1, progress=False)
    remote = load_manifest(f"pipe:cat {out}/{{file}}")
    assert remote["tokenizer_path"].startswith(str(cache)) and remote["tokenizer_path"].endswith("tokenizer.json")
    assert load_tokenizer(remote["tokenizer_path"]).eos_id == man["eos_id"]
    assert load_manifest(f"pipe:cat {out}/{{file}}")["tokenizer_path"] == remote["tokenizer_path"]  # cached


@pytest.mark.parametrize("num_workers", [0, 2])
def test_http_resume_mid_shard_in_order_is_exact(prepared, serve, num_workers):
    """Read in order, a remote shard streams; a run stopped inside a shard resumes at its exact
    window (the shard's start is read again and dropped), with the positions a local copy gives."""
    out, _ = prepared
    url = serve(out)
    cfg, local = (data_cfg(p, shuffle=False, num_workers=num_workers) for p in (url, out))
    k, more = 3, 20
    ref = take(build_train_loader(cfg, B), k + more)
    local_loader = build_train_loader(local, B)
    _same(ref, take(local_loader, k + more))
    loader = build_train_loader(cfg, B)
    first = take(loader, k)
    sd = json.loads(json.dumps(loader.state_dict()))
    epoch, shard, window, _ = sd["streams"][0]
    assert shard == 0 and 0 < window  # inside the first shard
    resumed = build_train_loader(cfg, B)
    resumed.load_state_dict(sd)
    _same(first + take(resumed, more), ref)
    assert resumed.state_dict() == local_loader.state_dict()  # the same positions, shard ends included


def test_a_shard_streams_through_a_bounded_reader(prepared, serve, tmp_path, monkeypatch):
    """A shard many times larger than the read size is read in reads of at most that size, and
    cutting it into windows in order never holds more than a small part of it (Python heap,
    measured with tracemalloc while the whole shard is consumed)."""
    import tracemalloc

    from tests.data.corpus import make_texts, write_corpus
    from ttt_lm.data import shards as shards_mod
    from ttt_lm.data.loader import iter_stream

    raw = write_corpus(str(tmp_path / "raw"), make_texts(800, seed=1, min_words=120, max_words=200))
    big = str(tmp_path / "big")
    man = prepare([raw], big, tokenizer=prepared[0], shard_tokens=10 ** 7, val_fraction=0, workers=1,
                  progress=False)
    shard = man["splits"]["train"]["shards"][0]
    assert len(man["splits"]["train"]["shards"]) == 1 and shard["bytes"] > 1 << 20
    chunk = 4096
    monkeypatch.setattr(shards_mod, "READ_CHUNK", chunk)
    opened = []

    class Watched(shards_mod.ShardStream):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            opened.append(self)

    monkeypatch.setattr(shards_mod, "ShardStream", Watched)
    url = serve(big)
    plan = build_train_loader(data_cfg(url, shuffle=False, seq_len=256), B).plan
    assert plan.streams_shards
    n_windows = (shard["tokens"] - 1) // 256
    tracemalloc.start()
    try:
        got = 0
        for tokens, _, _, nxt in iter_stream(plan, 0, (0, 0, 0)):
            got += 1
            if nxt[1] == 1:  # the position after the shard's last window
                break
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == n_windows
    (stream,) = opened
    assert stream.bytes == shard["bytes"] and 0 < stream.largest <= chunk
    assert peak < shard["bytes"] // 4, (peak, shard["bytes"])  # ~0.23 MB of 1.85 MB here; read whole: ~19 MB
    # the same windows as the whole shard read at once, locally
    whole = build_train_loader(data_cfg(big, shuffle=False, seq_len=256), B).plan
    a = [t for t, _, _, _ in itertools.islice(iter_stream(whole, 0, (0, 0, 0)), n_windows)]
    b = [t for t, _, _, _ in itertools.islice(iter_stream(plan, 0, (0, 0, 0)), n_windows)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_a_url_base_with_a_query_string(prepared, serve):
    """A container-wide token in the query string goes on every file's URL and stays out of messages."""
    out, _ = prepared
    url = serve(out)
    signed = url + "?sv=2024&sig=SECRET"
    assert load_manifest(signed)["root"] == signed
    assert locate(signed, "manifest.json") == url + "/manifest.json?sv=2024&sig=SECRET"
    _same(take(build_train_loader(data_cfg(signed), B), 5), take(build_train_loader(data_cfg(out), B), 5))
    with pytest.raises(DataError) as e:
        load_manifest(url + "/nothing?sig=SECRET")
    msg = _one_line(e)
    assert "SECRET" not in msg and f"{url}/nothing/manifest.json?…" in msg and "HTTP error" in msg
