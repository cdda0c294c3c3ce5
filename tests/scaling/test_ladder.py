"""Ladders: the shape rule, exact counts, token budgets, schedules, the written configs and sweep
list, the recipes of the 125M-1.3B presets, and the trainer's global batch."""
import glob
import math
import os
import re

import pytest

from ttt_lm.config import load_config
from ttt_lm.info import param_counts
from ttt_lm.model.flops import flops_per_token
from ttt_lm.model.registry import builtin_kinds
from ttt_lm.scaling import ladder as Lm
from ttt_lm.train.config import TrainConfig
from ttt_lm.train.engine import ParallelConfigError, resolve_grad_accum

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")


def test_peak_lr_rule():
    for _, n, *_, lr in Lm.TTT_PAPER_LADDER:
        assert Lm.peak_lr(n) == pytest.approx(lr, rel=1e-12)
    assert Lm.peak_lr(1e6) == 3e-3 and Lm.peak_lr(1e10) == 1e-3
    lrs = [Lm.peak_lr(n) for n in (1e8, 2e8, 5e8, 1e9, 2e9)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert 1.5e-3 > Lm.peak_lr(500e6) > 1.25e-3


#: (preset, overrides): the default tiny model deeper and wider, the hybrid and Griffin presets
#: (their own patterns: TTT-Linear ×3 + attention; RG-LRU ×2 + local MQA), and each built-in kind alone
COUNT_CASES = [
    ("tiny", ["model.d_model=96", "model.n_layers=12", "model.n_heads=3"]),
    ("tiny_hybrid", ["model.d_model=64", "model.n_layers=12", "model.n_heads=2"]),
    ("tiny_griffin", ["model.d_model=64", "model.n_layers=9", "model.n_heads=2"]),
] + [("tiny", [f"model.layer_pattern=[{k}]", "model.d_model=64", "model.n_layers=4", "model.n_heads=2"])
     for k in builtin_kinds()]


@pytest.mark.parametrize("preset,overrides", COUNT_CASES,
                         ids=["tiny", "tiny_hybrid", "tiny_griffin"] + list(builtin_kinds()))
@pytest.mark.slow
def test_counts_from_two_shallow_models_are_exact(preset, overrides):
    m = load_config(os.path.join(CONFIGS, f"{preset}.yaml"), overrides).model
    assert Lm.counts(m) == param_counts(m)
    assert Lm.train_flops_per_token(m, 256) == pytest.approx(flops_per_token(m, 256)["train"], rel=1e-12)


@pytest.mark.slow
def test_shape_rule():
    fam = load_config(os.path.join(CONFIGS, "hybrid_125m.yaml")).model
    for target in (50e6, 125e6, 400e6):
        m, c = Lm.shape_for(fam, target, head_dim=64, aspect=64)
        assert m.n_layers % 4 == 0 and m.d_model % 64 == 0 and m.n_heads == m.d_model // 64
        assert m.layer_pattern == fam.layer_pattern
        assert abs(math.log(c["total"] / target)) < math.log(1.3)
        # no other depth of the rule is nearer the target
        for L in (m.n_layers - 4, m.n_layers + 4):
            if L > 0:
                other = Lm.counts(Lm.shaped(fam, L, 64, 64))["total"]
                assert abs(math.log(other / target)) >= abs(math.log(c["total"] / target))
    assert Lm.shaped(fam, 8, 64, 64).d_ff % 16 == 0
    mamba = load_config(os.path.join(CONFIGS, "mamba_130m.yaml")).model
    assert Lm.shaped(mamba, 8, 64, 64).d_ff == 0  # a family without MLP stays without
    griffin = load_config(os.path.join(CONFIGS, "griffin_125m.yaml")).model
    assert Lm.shaped(griffin, 6, 64, 64).attention.num_kv_heads == 1  # MQA stays MQA
    with pytest.raises(Lm.LadderError, match="no shape"):
        Lm.shape_for(fam, 10.0)


def test_sections_without_scaled_are_copied():
    """A section whose sizes do not follow the width (no ``scaled``) is copied into the widened
    model as the family has it (here every section at its tiny sizes, away from its defaults);
    those with ``scaled`` are checked in their kinds' files (test_attention_scaled.py,
    test_rglru_scaled.py)."""
    from tests.model.mixer_checks import short_sections
    from ttt_lm.model.config import ModelConfig
    fam = short_sections(ModelConfig(d_model=128, n_heads=4, n_layers=3, layer_pattern=[builtin_kinds()[0]]), 3)
    m = Lm.shaped(fam, 6, 64, 64)   # d_model 384, 6 heads of 64
    assert (m.d_model, m.n_heads) == (384, 6)
    copied = [n for n, sec in fam.sections().items() if not callable(getattr(sec, "scaled", None))]
    assert copied and len(copied) < len(fam.sections())
    for n in copied:
        assert getattr(m, n) == getattr(fam, n), n


TINY = ["model.vocab_size=512", "data.seq_len=64", "train.micro_batch_size=4"]


@pytest.mark.slow
def test_ladder_by_size(tmp_path):
    runs = Lm.plan([os.path.join(CONFIGS, "tiny_transformer.yaml"), os.path.join(CONFIGS, "tiny_ttt_linear.yaml")],
                   str(tmp_path), sizes=[30e3, 100e3], tokens_per_param=5, count="non_embedding", head_dim=16,
                   aspect=16, batch_tokens=512, overrides=TINY)
    assert [r.arch for r in runs] == ["tiny_transformer"] * 2 + ["tiny_ttt_linear"] * 2
    assert len({r.name for r in runs}) == 4
    for r in runs:
        cfg = load_config(r.config)
        assert param_counts(cfg.model) == {"total": r.params_total, "non_embedding": r.params_non_embedding}
        # 5 tokens per parameter, to within half a batch (or evals/2 = 5 batches where the step
        # count is rounded to a multiple of the 10 validation passes)
        assert r.tokens == r.steps * 512 and abs(r.tokens - 5 * r.params_non_embedding) <= 5.5 * 512
        assert cfg.train.max_steps == r.steps and cfg.train.global_batch_size == 8
        assert cfg.optim.warmup_steps == max(1, round(0.1 * r.steps)) and cfg.optim.min_lr_ratio == 0.1
        assert cfg.optim.schedule == "cosine" and cfg.optim.lr == pytest.approx(3e-3)
        assert r.flops == pytest.approx(flops_per_token(cfg.model, 64)["train"] * r.tokens, rel=1e-12)
        assert cfg.train.max_steps % cfg.eval.every == 0  # the last validation is at the final step
        assert cfg.model.vocab_size == 512 and cfg.train.run_dir == os.path.join(str(tmp_path), "runs", r.name)
    assert [r.name for r in Lm.read_plan(str(tmp_path))] == [r.name for r in runs]
    lines = [x for x in open(tmp_path / "sweep.txt").read().splitlines() if not x.startswith("#")]
    assert lines == [os.path.abspath(r.config) for r in runs]


@pytest.mark.slow
def test_isoflop_ladder(tmp_path):
    runs = Lm.plan([os.path.join(CONFIGS, "tiny_transformer.yaml")], str(tmp_path), budgets=[1e11, 1e12],
                   sizes=[30e3, 100e3, 300e3], count="non_embedding", head_dim=16, aspect=16, batch_tokens=512,
                   overrides=TINY)
    assert len(runs) == 6 and [r.budget for r in runs] == [1e11] * 3 + [1e12] * 3
    for r in runs:  # the budget is met to within half a batch, or evals/2 batches where steps are rounded
        assert abs(r.flops - r.budget) <= r.flops_per_token * 512 * (10 / 2 + 0.5)
        assert load_config(r.config).train.max_steps % load_config(r.config).eval.every == 0
    # the centre rule: sizes log-spaced around sqrt(C/120)
    runs = Lm.plan([os.path.join(CONFIGS, "transformer_125m.yaml")], str(tmp_path / "c"), budgets=[2e19],
                   per_budget=3, span=2.0)
    for r in runs:  # thousands of steps: validated about 10 times, the last at the final step
        every = load_config(r.config).eval.every
        assert r.steps % every == 0 and 10 <= r.steps // every <= 40
    assert [r.params_total < s.params_total for r, s in zip(runs, runs[1:])] == [True, True]
    assert runs[1].params_total == pytest.approx(math.sqrt(2e19 / 120), rel=0.25)


@pytest.mark.parametrize("kw,match", [
    ({}, "give target sizes"),
    ({"sizes": [-1.0]}, "positive"),
    ({"sizes": [1e5], "batch_tokens": 100}, "whole number"),
])
def test_bad_ladders_are_refused(tmp_path, kw, match):
    with pytest.raises(Lm.LadderError, match=match):
        Lm.plan([os.path.join(CONFIGS, "tiny_transformer.yaml")], str(tmp_path), **kw)
    assert Lm._eval_every(48, 4) == 12 and Lm._eval_every(19, 4) == 1 and Lm._eval_every(143, 10) == 13
    with pytest.raises(Lm.LadderError, match="cannot read"):
        Lm.parse_amount("12Q")
    assert Lm.parse_amount("1.3B") == 1.3e9 and Lm.parse_amount("20k") == 2e4


PAPER = {name: (steps, lr) for name, _, _, _, _, steps, lr in Lm.TTT_PAPER_LADDER}


def _built_on_sizes(path: str) -> bool:
    """Whether the preset takes its shape and recipe from configs/sizes/ (through its _base_ chain):
    the TTT paper's ladder. Presets of another paper's recipe at these sizes are left to their own tests."""
    import yaml
    bases = (yaml.safe_load(open(path)) or {}).get("_base_") or []
    bases = [bases] if isinstance(bases, str) else bases
    here = os.path.dirname(path)
    return any(b.startswith("sizes/") or _built_on_sizes(os.path.join(here, b)) for b in bases)


RECIPES = sorted(p for p in glob.glob(os.path.join(CONFIGS, "*.yaml"))
                 if re.search(r"_(125m|350m|760m|1\.3b)\.yaml$", p) and _built_on_sizes(p))


@pytest.mark.parametrize("path", RECIPES, ids=[os.path.basename(p) for p in RECIPES])
def test_presets_are_the_ttt_paper_recipes(path):
    size = re.search(r"_(125m|350m|760m|1\.3b)\.yaml$", path).group(1)
    cfg = load_config(path)
    steps, lr = PAPER[size]
    t, o = cfg.train, cfg.optim
    assert t.max_steps == steps and o.lr == lr
    # the paper's 256 rows of 2048 tokens per step; LaCT, whose fast weights are written only for
    # chunks of 2048 that a later token follows, takes the same tokens as longer rows
    assert t.global_batch_size * cfg.data.seq_len == 256 * 2048
    assert cfg.data.seq_len == 2048 or cfg.model.layer_pattern == ["lact"]
    assert o.warmup_steps == steps // 10 and o.schedule == "cosine" and o.min_lr_ratio == 0.1
    assert t.precision == "bf16" and o.weight_decay == 0.1 and (o.beta1, o.beta2) == (0.9, 0.95)
    tokens = steps * 256 * 2048
    n = param_counts(cfg.model)["total"]
    assert 19.0 < tokens / n < 21.5, f"{tokens / n:.1f} tokens per parameter"   # Chinchilla: ~20
    assert t.global_batch_size % t.micro_batch_size == 0


def test_tiny_presets_stay_cpu_sized():
    cfg = load_config(os.path.join(CONFIGS, "tiny.yaml"))
    assert cfg.train.max_steps == 200 and cfg.train.precision == "fp32" and cfg.train.global_batch_size is None


def test_global_batch_size_sets_grad_accum():
    t = TrainConfig(micro_batch_size=8, global_batch_size=256)
    assert resolve_grad_accum(t, 8) == 4 and resolve_grad_accum(t, 32) == 1
    assert resolve_grad_accum(TrainConfig(micro_batch_size=8, grad_accum=3), 2) == 3
    with pytest.raises(ParallelConfigError, match="not a multiple"):
        resolve_grad_accum(t, 3)
    with pytest.raises(ParallelConfigError, match="contradicts"):
        resolve_grad_accum(TrainConfig(micro_batch_size=8, grad_accum=2, global_batch_size=256), 8)
