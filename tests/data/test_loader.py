import itertools
import os
import json

import pytest
import torch

from tests.data.corpus import SEQ_LEN, data_cfg
from ttt_lm.data import DataError, build_train_loader, build_val_loader, iter_documents
from ttt_lm.data.loader import iter_stream, merge_states

B = 4


def take(loader, n):
    return list(itertools.islice(iter(loader), n))


def all_documents(path):
    return {d: t for split in ("train", "val") for d, t in iter_documents(path, split, with_ids=True)}


def test_batch_layout_matches_the_documents(prepared):
    out, man = prepared
    docs = all_documents(out)
    eos = man["eos_id"]
    for batch in take(build_train_loader(data_cfg(out), B, 0, 1), 6):
        assert set(batch) == {"input_ids", "labels", "doc_ids", "position_ids"}
        for v in batch.values():
            assert v.shape == (B, SEQ_LEN) and v.dtype == torch.long
        x, y, d, p = batch["input_ids"], batch["labels"], batch["doc_ids"], batch["position_ids"]
        assert torch.equal(y[:, :-1], x[:, 1:])
        for b in range(B):
            for t in range(SEQ_LEN):
                # every input token is the token of its document at its position
                assert int(x[b, t]) == int(docs[int(d[b, t])][int(p[b, t])])
            # position 0 exactly where the previous token ended a document
            starts = (p[b, 1:] == 0)
            assert torch.equal(starts, x[b, :-1] == eos)
            last = docs[int(d[b, -1])]
            nxt = int(p[b, -1]) + 1
            if nxt < len(last):
                assert int(y[b, -1]) == int(last[nxt])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_yields_the_same_batches(prepared, num_workers):
    out, _ = prepared
    cfg = data_cfg(out, num_workers=num_workers)
    k, more = 7, 45
    uninterrupted = build_train_loader(cfg, 4 * B, 0, 1)
    ref = take(uninterrupted, k + more)
    # the run crosses an epoch boundary in every stream, so resuming across one is covered
    assert all(epoch >= 1 for epoch, _, _, _ in uninterrupted.state_dict()["streams"])
    loader = build_train_loader(cfg, 4 * B, 0, 1)
    first = take(loader, k)
    sd = json.loads(json.dumps(loader.state_dict()))
    assert sd["samples"] == k * 4 * B
    resumed = build_train_loader(cfg, 4 * B, 0, 1)
    resumed.load_state_dict(sd)
    rest = take(resumed, more)
    assert len(first + rest) == len(ref)
    for a, b in zip(first + rest, ref):
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_resume_twice_and_in_a_loop(prepared):
    """Interrupting at several points gives the same sequence as never stopping."""
    out, _ = prepared
    cfg = data_cfg(out, num_workers=0)
    ref = take(build_train_loader(cfg, B, 0, 1), 12)
    got, sd = [], None
    for n in (3, 1, 5, 3):
        loader = build_train_loader(cfg, B, 0, 1)
        if sd is not None:
            loader.load_state_dict(sd)
        got += take(loader, n)
        sd = loader.state_dict()
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(got, ref))


def test_same_seed_same_order_other_seed_or_epoch_differs(prepared):
    out, _ = prepared
    a = take(build_train_loader(data_cfg(out, seed=1), B), 3)
    b = take(build_train_loader(data_cfg(out, seed=1), B), 3)
    c = take(build_train_loader(data_cfg(out, seed=2), B), 3)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    assert not all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, c))


def _epoch_windows(plan, stream, epoch):
    """(doc_id, position) of every input token the stream reads in one epoch."""
    n_shards = len(plan.stream_shards(epoch, stream))
    seen = []
    for tokens, doc_ids, positions, nxt in iter_stream(plan, stream, (epoch, 0, 0)):
        seen += list(zip(doc_ids[:-1].tolist(), positions[:-1].tolist()))
        if nxt[0] != epoch or nxt[1] == n_shards:
            return seen


@pytest.mark.parametrize("num_workers", [0, 2])
def test_two_ranks_split_an_epoch(prepared, num_workers):
    out, man = prepared
    train = man["splits"]["train"]
    per_rank = []
    for rank in range(2):
        plan = build_train_loader(data_cfg(out, num_workers=num_workers), B, rank, 2).plan
        tokens = []
        for s in range(rank, plan.n_streams, 2):  # V a multiple of the ranks: rank r reads streams r, r + 2, ...
            tokens += _epoch_windows(plan, s, 0)
        per_rank.append(tokens)
        assert len(set(tokens)) == len(tokens)  # no token twice within a rank's epoch
    r0, r1 = (set(t) for t in per_rank)
    assert not r0 & r1
    union = r0 | r1
    train_docs = {d for d, _ in iter_documents(out, "train", with_ids=True)}
    assert {d for d, _ in union} == train_docs
    # all train tokens but the tails shorter than a window that each shard drops
    expected = sum((s["tokens"] - 1) // SEQ_LEN * SEQ_LEN for s in train["shards"])
    assert len(union) == expected
    assert expected > train["tokens"] - len(train["shards"]) * SEQ_LEN
    # the public loaders agree: rank batches are disjoint
    b0 = take(build_train_loader(data_cfg(out, num_workers=num_workers), B, 0, 2), 3)
    b1 = take(build_train_loader(data_cfg(out, num_workers=num_workers), B, 1, 2), 3)
    pairs = lambda bs: {(int(d), int(p)) for b in bs for d, p in zip(b["doc_ids"].flatten(), b["position_ids"].flatten())}
    assert not pairs(b0) & pairs(b1)


def test_epochs_reshuffle(prepared):
    out, _ = prepared
    plan = build_train_loader(data_cfg(out), B).plan
    e0, e1 = _epoch_windows(plan, 0, 0), _epoch_windows(plan, 0, 1)
    assert e0 != e1
    assert plan.stream_shards(0, 0) != plan.stream_shards(1, 0)


def test_no_shuffle_is_manifest_order(prepared):
    out, _ = prepared
    plan = build_train_loader(data_cfg(out, shuffle=False, streams=1), B).plan
    assert plan.stream_shards(0, 0) == plan.stream_shards(5, 0) == list(range(len(plan.shards)))


def test_resume_refuses_other_settings(prepared):
    out, _ = prepared
    loader = build_train_loader(data_cfg(out, streams=1), B)
    take(loader, 2)
    sd = loader.state_dict()
    other = build_train_loader(data_cfg(out, streams=2), B)
    with pytest.raises(DataError, match="total_streams: saved 1, now 2"):
        other.load_state_dict(sd)
    with pytest.raises(DataError, match="seed: saved 1234, now 3"):
        build_train_loader(data_cfg(out, seed=3, streams=1), B).load_state_dict(sd)
    with pytest.raises(DataError, match="rank 0 of 2 cannot be loaded by rank 1 of 2"):
        build_train_loader(data_cfg(out), B, 1, 2).load_state_dict(build_train_loader(data_cfg(out), B, 0, 2).state_dict())
    with pytest.raises(DataError, match="loader state version 1, expected 2"):
        loader.load_state_dict({**sd, "version": 1})


def test_val_loader_is_fixed_and_split_by_rank(prepared):
    out, man = prepared
    cfg = data_cfg(out)
    val = build_val_loader(cfg, B)
    a, b = list(val), list(val)
    assert len(a) == len(val) > 1
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    assert all(torch.equal(x["labels"][:, :-1], x["input_ids"][:, 1:]) for x in a)
    n_windows = (man["splits"]["val"]["tokens"] - 1) // SEQ_LEN
    assert sum(x["input_ids"].shape[0] for x in a) == n_windows
    val_docs = {d for d, _ in iter_documents(out, "val", with_ids=True)}
    assert {int(d) for x in a for d in x["doc_ids"].flatten()} == val_docs
    r = [list(build_val_loader(cfg, B, rank, 2)) for rank in range(2)]
    assert len(r[0]) == len(r[1])
    rows = lambda bs: [tuple(row.tolist()) for x in bs for row in x["position_ids"] * 1000 + x["doc_ids"]]
    assert not set(rows(r[0])) & set(rows(r[1]))
    assert len(rows(r[0])) + len(rows(r[1])) == n_windows // 2 * 2


def test_iter_documents_ranks(prepared):
    out, man = prepared
    docs = list(iter_documents(out, "train"))
    assert len(docs) == man["splits"]["train"]["documents"]
    assert all(int(d[-1]) == man["eos_id"] and d.dtype == torch.long for d in docs)
    halves = [list(iter_documents(out, "train", r, 2)) for r in range(2)]
    assert len(halves[0]) + len(halves[1]) == len(docs)
    assert all(torch.equal(x, y) for x, y in zip(halves[1], docs[1::2]))


def _step(loaders, global_batch):
    """One optimizer step's batches: ``global_batch / len(loaders)`` sequences from each rank."""
    per = global_batch // len(loaders)
    return [next(it) for it in loaders] if per else []


def _rows(batches):
    """(document, position) of each row's first token: one id per sample."""
    return [(int(b["doc_ids"][i, 0]), int(b["position_ids"][i, 0])) for b in batches for i in range(b["doc_ids"].shape[0])]


def _run(layouts, cfg, V, G):
    """Steps of global batch ``G`` on a sequence of layouts ``[(data-parallel ranks, steps), ...]``,
    the loader state carried across each change by ``merge_states`` (through JSON). Returns each
    step's set of sample ids."""
    steps, state = [], None
    for dp, n in layouts:
        loaders = [build_train_loader(cfg, G // dp, r, dp, total_streams=V) for r in range(dp)]
        if state is not None:
            for ld in loaders:
                ld.load_state_dict(state)
        its = [iter(ld) for ld in loaders]
        for _ in range(n):
            steps.append(sorted(_rows(next(it) for it in its)))
        state = json.loads(json.dumps(merge_states([ld.state_dict() for ld in loaders])))
        assert state["samples"] == len(steps) * G
    return steps


@pytest.mark.parametrize("num_workers,V", [(0, 1), (0, 2), (2, 2), (0, 3)])
def test_order_does_not_depend_on_the_rank_count_and_resumes_across_it(prepared, num_workers, V):
    """Sample i comes from stream i mod V and step n reads samples [nG, (n+1)G), whatever the
    rank count (a stream shared by ranks is read by each and split), so a run continues on 1, 2 or
    4 ranks with every step reading the same samples: none twice, none skipped."""
    out, _ = prepared
    cfg = data_cfg(out, num_workers=num_workers)
    G = 8
    ref = _run([(1, 12)], cfg, V, G)
    for layouts in ([(1, 3), (2, 3), (1, 3), (4, 3)], [(2, 5), (4, 1), (1, 6)]):
        got = _run(layouts, cfg, V, G)
        assert got == ref
    flat = [r for s in ref for r in s]
    assert len(flat) == 12 * G and len(set(flat)) == len(flat)  # no sample twice


def test_another_global_batch_keeps_the_sample_position(prepared):
    out, _ = prepared
    cfg = data_cfg(out)
    ref = _rows(take(build_train_loader(cfg, 24, 0, 1, total_streams=2), 2))  # 48 samples in one order
    a = build_train_loader(cfg, 8, 0, 1, total_streams=2)
    first = _rows(take(a, 3))  # 3 steps of 8
    two = [build_train_loader(cfg, 6, r, 2, total_streams=2) for r in range(2)]
    for ld in two:
        ld.load_state_dict(merge_states([a.state_dict()]))
    its = [iter(ld) for ld in two]
    rest = [r for _ in range(2) for it in its for r in _rows([next(it)])]  # 2 steps of 12
    assert sorted(first + rest) == sorted(ref)


def test_merge_refuses_what_cannot_continue_exactly(prepared):
    out, _ = prepared
    cfg = data_cfg(out)
    one = build_train_loader(cfg, B, 0, 1, total_streams=2)
    take(one, 3)
    merged = merge_states([one.state_dict()])
    with pytest.raises(DataError, match="total_streams: saved 2, now 1"):
        build_train_loader(data_cfg(out, streams=1), B, 0, 1).load_state_dict(merged)
    with pytest.raises(DataError, match="fewer than the 1000 data streams"):
        build_train_loader(cfg, B, 0, 1, total_streams=1000)
    r0 = build_train_loader(cfg, B, 0, 2)
    with pytest.raises(DataError, match=r"data-parallel ranks \[0\] given, the run had 2"):
        merge_states([r0.state_dict()])
    r1 = build_train_loader(cfg, B, 1, 2)
    take(r1, 1)
    with pytest.raises(DataError, match="read different numbers of samples"):
        merge_states([r0.state_dict(), r1.state_dict()])


@pytest.mark.parametrize("dp,V", [(1, 1), (1, 2), (2, 2), (2, 1), (2, 3)])
def test_shards_ahead_are_the_shards_the_next_samples_read(prepared, monkeypatch, dp, V):
    """``shards_ahead`` (from the manifest's token counts, nothing read) names exactly the shards
    that reading the next samples opens, from any position, also for streams shared by ranks."""
    import ttt_lm.data.loader as L
    out, _ = prepared
    opened = []
    real = L.read_shard

    def recording(root, shard, *a, **k):
        opened.append(shard["name"])
        return real(root, shard, *a, **k)

    monkeypatch.setattr(L, "read_shard", recording)
    cfg = data_cfg(out)
    for r in range(dp):
        sd = None
        for n in (2, 6, 10, 4, 30):  # each from a resumed loader: it opens its current shard again
            ld = build_train_loader(cfg, 2, r, dp, total_streams=V)
            if sd is not None:
                ld.load_state_dict(sd)
            names = [ld.plan.shards[i]["name"] for i in ld.shards_ahead(2 * n)]
            opened.clear()
            take(ld, n)
            assert sorted(set(opened)) == sorted(names), (r, n)
            assert len(names) == len(set(names))
            sd = ld.state_dict()


def test_check_ahead_names_a_bad_shard_before_it_is_read(prepared, tmp_path):
    import shutil
    out, _ = prepared
    copy = str(tmp_path / "data")
    shutil.copytree(out, copy)
    ld = build_train_loader(data_cfg(copy), 2, 0, 1, total_streams=2)
    assert ld.check_ahead(8) is None
    take(ld, 4)
    later = [i for i in ld.shards_ahead(200) if i not in ld.shards_ahead(8)]
    bad = ld.plan.shards[later[0]]["name"]
    with open(os.path.join(copy, bad), "r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 1]))
    assert ld.check_ahead(8) is None  # the next 8 samples do not read it
    msg = ld.check_ahead(200)
    assert msg is not None and bad in msg and "sha256 differs from the manifest" in msg
    assert ld.check_ahead(200) == msg  # kept: not hashed again
    fresh = build_train_loader(data_cfg(copy), 2, 0, 1, total_streams=2)
    fresh.load_state_dict(ld.state_dict())
    os.remove(os.path.join(copy, bad))  # gone after the start (whose manifest check names missing shards)
    missing = fresh.check_ahead(200)
    assert missing is not None and bad in missing and "cannot be read" in missing
