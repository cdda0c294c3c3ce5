"""Training end to end on a corpus served over HTTP (exact resume), and with model.compile."""
import functools
import http.server
import threading

import pytest

from launch import attention_and_scan, losses_by_step, metrics, model_overrides, run
from tests.data.corpus import SHARD_TOKENS, VOCAB, make_texts, write_corpus
from ttt_lm.data.prepare import prepare

# slow: each test trains in spawned processes
pytestmark = pytest.mark.slow

REAL = {"TTT_TEST_REAL_DATA": "1"}


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def corpus_url(tmp_path_factory):
    """A tiny prepared corpus served by a ThreadingHTTPServer on 127.0.0.1 (a free port)."""
    raw = write_corpus(str(tmp_path_factory.mktemp("raw")), make_texts(40))
    out = str(tmp_path_factory.mktemp("prepared"))
    prepare([raw], out, vocab_size=VOCAB, shard_tokens=SHARD_TOKENS, val_fraction=0.05, workers=1, progress=False,
            overwrite=True)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=out))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_http_corpus_trains_and_resumes_exactly(corpus_url, tmp_path, monkeypatch):
    monkeypatch.setenv("TTT_LM_CACHE", str(tmp_path / "cache"))
    common = [f"data.path={corpus_url}", f"model.vocab_size={VOCAB}", "train.max_steps=4", "eval.every=2",
              "eval.batches=2"]
    full = str(tmp_path / "full")
    r = run(full, common, env=REAL)
    # the validation loss is printed on the console (no progress bar here) and logged
    assert "[val] step 2 loss" in r.output() and "[val] step 4 loss" in r.output()
    assert [rec["step"] for rec in metrics(full, "val")] == [2, 4]
    assert "MFU not reported" in r.output()  # a CPU: no peak known, none configured
    part = str(tmp_path / "part")
    run(part, common + ["train.stop_after=2"], env=REAL)
    r = run(part, common, env=REAL)
    assert "resuming from" in r.output()
    assert losses_by_step(part) == losses_by_step(full)  # the same batches, bit for bit


def test_compile_trains_like_eager(tmp_path):
    common = [*model_overrides(attention_and_scan()), "train.max_steps=3"]
    eager, compiled = str(tmp_path / "eager"), str(tmp_path / "compiled")
    run(eager, common)
    r = run(compiled, common + ["model.compile=true", "model.compile_backend=aot_eager"])
    assert "blocks torch.compile-d (aot_eager" in r.output()
    a, b = losses_by_step(eager), losses_by_step(compiled)
    assert a.keys() == b.keys() == {1, 2, 3}
    # tolerance as in tests/model/test_compile.py
    assert max(abs(a[s] - b[s]) for s in a) < 1e-5, (a, b)
