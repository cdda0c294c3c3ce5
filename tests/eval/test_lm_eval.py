"""The lm-evaluation-harness adapter, run through lm_eval's own evaluator on local tasks
(tests/eval/lm_eval_tasks: three task YAMLs over one JSONL file), offline."""
import os

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.eval.conftest import export_model, tiny_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _evaluate(d, batch_size):
    import ttt_lm.eval.lm_eval_adapter  # noqa: F401  (registers "ttt_lm")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    cwd = os.getcwd()
    os.chdir(ROOT)  # the task YAMLs name their data file relative to the repository root
    try:
        return simple_evaluate(model="ttt_lm", model_args=f"checkpoint={d},device=cpu,chunk_len=16",
                               tasks=["ttt_tiny_choice", "ttt_tiny_rolling", "ttt_tiny_gen"], batch_size=batch_size,
                               task_manager=TaskManager(include_path=os.path.join(HERE, "lm_eval_tasks"),
                                                        include_defaults=False),
                               bootstrap_iters=0, log_samples=True)
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def harness_export(prepared, tmp_path_factory):
    # a recurrence (its state carried across a batch's rows of different lengths) and global attention
    from ttt_lm.model.registry import kinds_with
    pattern = (kinds_with(lambda c: not c.attends)[0], kinds_with(lambda c: c.global_attention)[0])
    m = tiny_model(pattern, max_seq_len=64)
    return export_model(m, str(tmp_path_factory.mktemp("harness")), prepared), m


@pytest.fixture(scope="module")
def harness_results(harness_export):
    """Batches of 3: rows of different lengths padded together (scoring) and prompts of different
    lengths advancing together (generation); the tests below compare them with one-row passes."""
    d, m = harness_export
    return _evaluate(d, 3), m


def _logprob(m, ids, n_cont):
    with torch.no_grad():
        lp = F.log_softmax(m(torch.tensor([ids[:-1]])).logits[0].float(), -1)
    tgt = torch.tensor(ids[1:])
    return float(lp.gather(1, tgt[:, None])[-n_cont:].sum())


def test_multiple_choice_accuracy_is_our_own_argmax(harness_results, tokenizer):
    res, m = harness_results
    got = res["results"]["ttt_tiny_choice"]["acc,none"]
    correct = []
    for s in res["samples"]["ttt_tiny_choice"]:
        doc = s["doc"]
        scores = []
        for c in doc["choices"]:
            if doc["question"]:
                ctx = tokenizer.encode(doc["question"])
                whole = tokenizer.encode(doc["question"] + c)
            else:
                ctx, whole = [tokenizer.eos_id], [tokenizer.eos_id] + tokenizer.encode(c)
            scores.append(_logprob(m, whole, len(whole) - len(ctx)))
        # the harness's per-choice log-likelihoods are ours (float32, 16-token chunks vs one pass)
        harness = [r[0] for r in s["filtered_resps"]]
        assert harness == pytest.approx(scores, abs=1e-4)
        correct.append(max(range(len(scores)), key=scores.__getitem__) == doc["answer"])
    assert len(correct) == 5 and got == pytest.approx(sum(correct) / 5)


def test_rolling_loglikelihood_is_the_documents_log_probability(harness_results, tokenizer):
    res, m = harness_results
    total_ll, words = 0.0, 0
    for s in res["samples"]["ttt_tiny_rolling"]:
        text = s["doc"]["question"] + s["doc"]["choices"][0]
        ids = [tokenizer.eos_id] + tokenizer.encode(text)
        total_ll += _logprob(m, ids, len(ids) - 1)
        words += len(text.split())
    wp = res["results"]["ttt_tiny_rolling"]["word_perplexity,none"]
    assert wp == pytest.approx(math.exp(-total_ll / words), rel=1e-4)


def test_generation_is_greedy_and_stops_at_until(harness_results, tokenizer):
    from ttt_lm.eval.passkey import greedy_continue
    res, m = harness_results
    for s in res["samples"]["ttt_tiny_gen"]:
        q = s["doc"]["question"]
        ids = tokenizer.encode(q) or [tokenizer.eos_id]
        want = tokenizer.decode(greedy_continue(m, ids, 5, chunk_len=16))
        for u in ("\n", "."):
            want = want.split(u)[0]
        assert s["resps"][0][0] == want
    assert 0.0 <= res["results"]["ttt_tiny_gen"]["exact_match,none"] <= 1.0


def test_bad_tokenizer_is_refused(tmp_path, prepared):
    from ttt_lm.eval import EvalError
    from ttt_lm.eval.lm_eval_adapter import TTTLMHarness
    d = export_model(tiny_model(vocab_size=100), str(tmp_path / "v100"), prepared)
    with pytest.raises(EvalError, match="vocabulary mismatch"):
        TTTLMHarness(checkpoint=d)


def test_batch_size_does_not_change_the_responses(harness_results, harness_export):
    one = _evaluate(harness_export[0], 1)
    three = harness_results[0]
    for task in ("ttt_tiny_choice", "ttt_tiny_rolling", "ttt_tiny_gen"):
        for a, b in zip(one["samples"][task], three["samples"][task], strict=True):
            assert a["doc"] == b["doc"]
            if task == "ttt_tiny_gen":
                assert a["resps"] == b["resps"]
            else:  # float32 sums of a padded batch vs one row
                for ra, rb in zip(a["resps"], b["resps"], strict=True):
                    assert (ra[0][0] if isinstance(ra[0], (list, tuple)) else ra[0]) == pytest.approx(
                        rb[0][0] if isinstance(rb[0], (list, tuple)) else rb[0], abs=1e-4)


def test_auto_batch_size_is_refused(harness_export):
    from ttt_lm.eval import EvalError
    from ttt_lm.eval.lm_eval_adapter import TTTLMHarness
    with pytest.raises(EvalError, match="batch_size=auto is not supported"):
        TTTLMHarness(checkpoint=harness_export[0], batch_size="auto")


def test_pretrained_is_another_name_for_checkpoint(harness_export, prepared):
    from ttt_lm.eval import EvalError
    from ttt_lm.eval.lm_eval_adapter import TTTLMHarness
    d, m = harness_export
    h = TTTLMHarness(pretrained=d, device="cpu")
    assert torch.equal(h.model.embed.weight, m.embed.weight)
    with pytest.raises(EvalError, match="two checkpoints"):
        TTTLMHarness(pretrained=d, checkpoint=prepared, device="cpu")


def test_padding_ids_are_never_the_answer(tokenizer):
    """A model whose vocabulary is padded beyond the tokenizer's, with logits that favour the
    padding: generation and the greedy check of a continuation both keep to the tokenizer's ids."""
    from tests.eval.test_export_generate import _padded_model
    from ttt_lm.eval.lm_eval_adapter import TTTLMHarness
    V = tokenizer.vocab_size
    h = TTTLMHarness(model=_padded_model(V, V + 20), tokenizer_obj=tokenizer, device="cpu", chunk_len=16,
                     max_gen_toks=6)
    seen = []

    class Recording:  # the tokenizer, recording every id list it decodes
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def decode(self, ids):
            seen.append(list(ids))
            return tokenizer.decode(ids)

    h.tok = Recording()
    h._generate_batch([tokenizer.encode("the quick"), tokenizer.encode("a lazy dog")], 6, 0.0, [])
    assert seen and all(i < V for ids in seen for i in ids)
    # lm_eval's is_greedy: the continuation the model ranks first among the tokenizer's ids is greedy
    # (unmasked, a padding id would always rank first and nothing would be)
    ctx = tokenizer.encode("the quick brown")
    with torch.no_grad():
        best = int(h.model(torch.tensor([ctx])).logits[0, -1, :V].argmax())
    other = (best + 1) % V
    (_, greedy), (_, not_greedy) = h._score_batch([(ctx + [best], 1), (ctx + [other], 1)])
    assert greedy and not not_greedy


@pytest.mark.slow
def test_the_cached_task_index_is_lm_evals_own(tmp_path, monkeypatch):
    """The adapter keeps lm_eval's index of its own tasks in a file (lm_eval parses its ~14,000
    task YAMLs at every TaskManager): built and written once, then read, and equal to lm_eval's own
    index entry by entry; a folder beside it (--include_path) still overrides it."""
    import inspect
    import pathlib
    import pickle

    import ttt_lm.eval.lm_eval_adapter  # noqa: F401
    import lm_eval.tasks as tasks
    from lm_eval.tasks._index import TaskIndex
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    build = TaskIndex.build
    assert getattr(build, "_ttt_lm_cached", False), "importing the adapter keeps lm_eval's index cached"
    defaults, local = pathlib.Path(tasks.__file__).parent, pathlib.Path(HERE) / "lm_eval_tasks"
    first = build([defaults, local])
    (cached,) = (tmp_path / "ttt_lm").glob("lm_eval_task_index_*.pkl")
    with open(cached, "rb") as f:
        stored = pickle.load(f)
    written = cached.stat().st_mtime_ns
    second = build([defaults, local])                      # read from the file: not written again
    assert cached.stat().st_mtime_ns == written and list((tmp_path / "ttt_lm").iterdir()) == [cached]
    own = inspect.getclosurevars(build).nonlocals["build"]([defaults, local])   # lm_eval's TaskIndex.build
    key = lambda e: (e.kind, e.yaml_path, e.tags, repr(e.cfg))  # noqa: E731
    assert first.keys() == second.keys() == own.keys() and len(stored) > 1000
    assert all(key(first[k]) == key(second[k]) == key(own[k]) for k in own)
    assert "ttt_tiny_choice" in own and own["ttt_tiny_choice"].yaml_path.parent == local
