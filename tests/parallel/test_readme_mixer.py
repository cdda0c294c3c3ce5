"""The "Adding a mixer" example of docs/adding_a_mixer.md, run as it stands: its code block is executed, a tiny LM
with the new kind is built, and the model runs through 2-rank tensor parallelism and 2-rank
context parallelism (real gloo processes on CPU), compared with one process. Its config section
(``model.gated_sum``) is read, checked and, through ``python train.py`` with
``model.gated_sum.width=8`` on the command line, trained for 2 steps.

Tolerance: float64 throughout. The parallel runs reorder sums only (row-parallel partial sums
added by an all-reduce; chunk summaries combined across ranks), so they agree with one process
to rounding, ~1e-15 relative; rtol = 1e-9, atol = 1e-12 still fails on a wrong slice, a missing
state or a wrong position, which are O(1) errors.
"""
from __future__ import annotations

import copy
import pathlib
import re
import sys
import types

import pytest
import torch
import torch.distributed as dist

from tests.distributed import assert_all_passed, spawn_checks

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "adding_a_mixer.md"
TOL = dict(rtol=1e-9, atol=1e-12)
WORLD = 2
KIND = "gated_sum"


def readme_block() -> str:
    """The first ```python block of docs/adding_a_mixer.md."""
    text = PAGE.read_text()
    assert re.search(r"^# Adding a mixer$", text, flags=re.M), f"{PAGE} has no '# Adding a mixer' title"
    code = re.search(r"```python\n(.*?)```", text, flags=re.S)
    assert code, f"{PAGE} has no python code block"
    return code.group(1)


def load_readme_mixer() -> dict:
    """Execute the page's block as a module of its own (it registers its kind), importable as
    ``readme_adding_a_mixer`` as a plugin's module would be (its dataclass state needs that)."""
    mod = sys.modules.get("readme_adding_a_mixer")
    if mod is None:
        mod = types.ModuleType("readme_adding_a_mixer")
        sys.modules[mod.__name__] = mod
        exec(compile(readme_block(), "docs/adding_a_mixer.md", "exec", dont_inherit=True), mod.__dict__)
    return mod.__dict__


def _cfg(pattern, **kw):
    """The shared tests' tiny config of ``pattern`` (every section at its ``short(2)``/``tiny(2)``),
    at this file's width; the page's own section keeps the defaults its code block declares."""
    from tests.model.mixer_checks import short_config
    return short_config(list(pattern), 2, vocab_size=32, d_model=16, n_heads=4, d_ff=24, tie_embeddings=False, **kw)


def _model(cfg):
    from ttt_lm.model.lm import LM
    torch.manual_seed(0)
    m = LM(cfg).double()
    with torch.no_grad():  # away from the structured init (zero biases, unit gains)
        gen = torch.Generator().manual_seed(7)
        for prm in m.parameters():
            prm.add_(0.05 * torch.randn(prm.shape, generator=gen, dtype=prm.dtype))
    return m


def _batch(T=11):
    gen = torch.Generator().manual_seed(100)
    ids = torch.randint(0, 32, (2, T), generator=gen)
    labels = torch.randint(0, 32, (2, T), generator=gen)
    labels[0, :2] = -100
    return ids, labels


def _close(a, b, msg):
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{msg}: {m}")


# ---- in one process --------------------------------------------------------------------------
def test_readme_mixer_registers_and_its_forms_agree():
    ns = load_readme_mixer()
    from ttt_lm.model.mixers import mixer_class
    from ttt_lm.model.registry import layer_kinds
    assert KIND in layer_kinds() and mixer_class(KIND) is ns["GatedSum"]
    model = _model(_cfg([KIND, "attention"]))
    ids, _ = _batch(9)
    chunked = model(ids).logits
    ref = model.set_impl("reference")(ids).logits
    model.set_impl("chunked")
    _close(ref, chunked, "reference vs chunked form")
    # prefix in one pass, then token by token with the decode form
    out = model(ids[:, :5], output_states=True)
    states, steps = out.states, [out.logits]
    for t in range(5, 9):
        lg, states = model.step(ids[:, t], states)
        steps.append(lg[:, None])
    _close(torch.cat(steps, 1), chunked, "decode steps vs one pass")


def test_a_plan_that_does_not_fit_is_refused_before_any_change(monkeypatch):
    """Checked without a process group (``_check`` runs before any collective or conversion)."""
    ns = load_readme_mixer()
    from ttt_lm.model.config import ModelConfig
    from ttt_lm.model.lm import LM
    from ttt_lm.model.mixers.base import TPPlan
    from ttt_lm.parallel.tp_model import _check
    cfg = ModelConfig(vocab_size=32, d_model=18, head_dim=4, n_heads=4, n_layers=1, layer_pattern=[KIND], d_ff=24)
    model = LM(cfg)
    with pytest.raises(ValueError, match=r"tensor_parallel=4 must divide width=18 of layer 0 \(gated_sum\)"):
        _check(model, 4, False)
    monkeypatch.setattr(ns["GatedSum"], "tp_plan", classmethod(lambda cls, cfg: TPPlan(column=("q_proj",))))
    with pytest.raises(ValueError, match=r"names attribute\(s\) the mixer does not have: \['q_proj'\]"):
        _check(model, 2, False)
    assert type(model.layers[0].mixer.a_proj) is torch.nn.Linear   # untouched


def test_readme_mixer_section_is_read_from_its_config():
    """``model.gated_sum`` comes from the example's own dataclass: its fields set the layer, a
    misspelt field is named with the right one, a value out of range is refused."""
    load_readme_mixer()
    from ttt_lm.config import ConfigError, load_config
    cfg = _cfg([KIND, "attention"])
    assert cfg.gated_sum.width is None and _model(cfg).layers[0].mixer.width == 16
    cfg.gated_sum.width, cfg.gated_sum.chunk_size = 6, 4
    mx = _model(cfg).layers[0].mixer
    assert (mx.width, mx.chunk_size, tuple(mx.a_proj.weight.shape)) == (6, 4, (6, 16))
    base = ["model.layer_pattern=[gated_sum,attention]"]
    with pytest.raises(ConfigError, match=r"model\.gated_sum\.widht.*'width'"):
        load_config("configs/tiny.yaml", base + ["model.gated_sum.widht=8"])
    with pytest.raises(ConfigError, match=r"model\.gated_sum\.chunk_size must be >= 1, got 0"):
        load_config("configs/tiny.yaml", base + ["model.gated_sum.chunk_size=0"])


@pytest.mark.slow
def test_readme_mixer_trains_through_train_py_with_its_section_from_the_command_line(tmp_path):
    """A user's run: the page's block saved as a module, named in ``model.mixer_modules``, and
    ``python train.py`` with ``model.gated_sum.width=8`` for 2 steps; the checkpoint's model (built
    again from the run's saved config) has 8 channels, and the saved config keeps the section."""
    import os
    import subprocess

    from omegaconf import OmegaConf

    from tests.data.corpus import SHARD_TOKENS, VOCAB, make_texts, write_corpus
    from ttt_lm.data.prepare import prepare
    load_readme_mixer()
    root = pathlib.Path(__file__).resolve().parents[2]
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "readme_adding_a_mixer.py").write_text(readme_block())
    data = str(tmp_path / "data")
    prepare([write_corpus(str(tmp_path / "raw"), make_texts(12))], data, vocab_size=VOCAB,
            shard_tokens=SHARD_TOKENS, val_fraction=0.1, workers=1, progress=False)
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(root), str(plugin)]))
    r = subprocess.run([sys.executable, "train.py", "configs/tiny.yaml", f"data.path={data}",
                        f"model.vocab_size={VOCAB + 20}", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
                        "model.layer_pattern=[gated_sum,attention]", "model.mixer_modules=[readme_adding_a_mixer]",
                        "model.gated_sum.width=8", "model.gated_sum.chunk_size=4", "data.seq_len=16",
                        "train.micro_batch_size=2", "train.max_steps=2", "optim.warmup_steps=1", "eval.every=0",
                        "logging.tensorboard=false", "logging.progress=false", "train.device=cpu",
                        f"train.run_dir={run_dir}"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    saved = OmegaConf.load(run_dir / "config.yaml").model
    assert (saved.gated_sum.width, saved.gated_sum.chunk_size, list(saved.mixer_modules)) == \
        (8, 4, ["readme_adding_a_mixer"])
    from ttt_lm.eval.checkpoint import load_checkpoint
    model = load_checkpoint(str(run_dir)).model
    mx = model.layers[0].mixer
    assert type(mx).layer_kind == KIND and (mx.width, mx.chunk_size) == (8, 4)
    assert tuple(mx.a_proj.weight.shape) == (8, 32) and tuple(mx.o_proj.weight.shape) == (32, 8)


# ---- in 2 processes ------------------------------------------------------------------------------
def check_tp():
    """TP=2 (with and without sequence parallelism): loss and every gradient equal one process."""
    from ttt_lm.parallel.groups import build_groups
    from ttt_lm.parallel.tp_model import gather_tp_tensor, parallelize_tp
    groups = build_groups(tp_size=WORLD)
    ids, labels = _batch(10)
    for sp in (False, True):
        ref = _model(_cfg([KIND, "attention", KIND]))
        tpm = parallelize_tp(copy.deepcopy(ref), groups, sequence_parallel=sp)
        assert isinstance(tpm.layers[0].mixer.a_proj, torch.nn.Module) and tpm.layers[0].mixer.width == 16 // WORLD
        want = ref(ids, labels)
        want.loss.backward()
        got = tpm(ids, labels)
        got.loss.backward()
        _close(got.loss, want.loss, f"loss (sp={sp})")
        grads = dict(ref.named_parameters())
        for name, p in tpm.named_parameters():
            g = gather_tp_tensor(p.grad, getattr(p, "partition_dim", None), groups.tp_group)
            _close(g, grads[name].grad, f"gradient of {name} (sp={sp})")


def check_tp_position_ids():
    """TPLM.forward passes position_ids on: document resets inside rows match one process."""
    from ttt_lm.parallel.groups import build_groups
    from ttt_lm.parallel.tp_model import parallelize_tp
    groups = build_groups(tp_size=WORLD)
    ids, labels = _batch(10)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1], [5, 6, 7, 8, 0, 1, 2, 3, 4, 5]])
    ref = _model(_cfg([KIND, "attention"], reset_at_doc_boundaries=True))
    tpm = parallelize_tp(copy.deepcopy(ref), groups)
    want, plain = ref(ids, labels, position_ids=pos), ref(ids, labels)
    got = tpm(ids, labels, position_ids=pos)
    _close(got.loss, want.loss, "loss with document resets")
    assert not torch.allclose(want.loss, plain.loss), "the resets must change the loss for this check to mean anything"


def check_cp():
    """CP=2: each rank's slice, loss mean and averaged gradients equal one process."""
    from ttt_lm.parallel import cp
    ids, labels = _batch(11)
    rank = dist.get_rank()
    lengths = cp.split_lengths(ids.shape[1], WORLD)
    s, e = sum(lengths[:rank]), sum(lengths[:rank + 1])
    ref = _model(_cfg([KIND, "attention", KIND]))
    model = copy.deepcopy(ref)
    assert cp.block_scheme(model.layers[0]) == "parallel"
    with torch.no_grad():   # with labels the LM returns the loss and no logits (chunked head + loss)
        want_logits = ref(ids).logits
    want = ref(ids, labels)
    want.loss.backward()
    loss, logits = cp.context_parallel_forward(model, ids[:, s:e], labels[:, s:e])
    loss.backward()
    cp.allreduce_gradients(model)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    _close(mean.reshape(()) / WORLD, want.loss, "loss")
    _close(logits, want_logits[:, s:e], "logits of this rank's slice")
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        _close(p.grad, grads[name].grad, f"gradient of {name}")


CHECKS = [("tp", check_tp), ("tp_position_ids", check_tp_position_ids), ("cp", check_cp)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    # a spawned process starts with an empty registry: load_readme_mixer first
    return spawn_checks(WORLD, __name__, tmp_path_factory.mktemp("readme_mixer"), setup="load_readme_mixer")


@pytest.mark.dist
@pytest.mark.parametrize("check", [n for n, _ in CHECKS])
def test_readme_mixer_parallel(results, check):
    assert_all_passed(results[0], check, results[1])
