"""Fixtures for the slurm tier: a real one-node Slurm cluster (installed with apt-get when missing)
and a tiny prepared corpus for the real train.py.

Where Slurm cannot be installed (not root, no apt-get, apt-get failing) the slurm tests skip
with the reason; with CI=true they fail instead, so CI never passes without running them.
"""
import random

import pytest

from tests.slurm.cluster import LocalSlurm, SlurmUnavailable, ensure_installed, unavailable


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A running LocalSlurm; its daemons are stopped at the end of the session, also on failure."""
    try:
        ensure_installed()
    except SlurmUnavailable as e:
        unavailable(str(e))
    cluster = LocalSlurm(str(tmp_path_factory.mktemp("slurm")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


WORDS = "the quick brown fox jumps over a lazy dog while seven old kings sang loud songs of war and peace".split()
VOCAB = 300  # the smallest SentencePiece vocabulary that covers 3 specials + 256 bytes + characters


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A prepared corpus of random sentences (a few thousand tokens; prepared in well under 1 s)."""
    from ttt_lm.data.prepare import prepare
    raw = tmp_path_factory.mktemp("raw")
    rng = random.Random(0)
    for i in range(20):
        lines = (" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(30))
        (raw / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n")
    out = str(tmp_path_factory.mktemp("corpus"))
    prepare([str(raw)], out, vocab_size=VOCAB, shard_tokens=2000, val_fraction=0.1, workers=1,
            progress=False, overwrite=True)
    return out
