import pytest

from tests.data.corpus import SHARD_TOKENS, VOCAB, write_corpus, make_texts  # noqa: F401
from ttt_lm.data.prepare import prepare


@pytest.fixture(scope="session")
def corpus_texts():
    return make_texts(40)


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, corpus_texts):
    """A tiny prepared corpus: 40 documents, ~10 train shards, 2 val documents."""
    raw = write_corpus(str(tmp_path_factory.mktemp("raw")), corpus_texts, jsonl_from=30)
    out = str(tmp_path_factory.mktemp("prepared"))
    man = prepare([raw], out, vocab_size=VOCAB, shard_tokens=SHARD_TOKENS, val_fraction=0.05, workers=1,
                  progress=False, overwrite=True)
    return out, man

