import glob
import os
import re

import pytest
import torch

from tests.model.mixer_checks import preset_config, short_sections
from ttt_lm.config import load_config
from ttt_lm.info import param_counts
from ttt_lm.model import LM, ModelConfig
from ttt_lm.model.lm import model_class
from ttt_lm.model.registry import builtin_kinds, kinds_with

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KINDS = builtin_kinds()
#: the kind with attention over every earlier token, and the first one with a sliding window
#: (KV exchange, not global): the layers each kind is stacked with
GLOBAL = kinds_with(lambda c: c.global_attention, KINDS)[0]
WINDOWED = kinds_with(lambda c: c.cp_form == "kv_exchange" and not c.global_attention, KINDS)[0]


def tiny_lm(pattern, n_layers=None, dtype=torch.float64, **kw) -> LM:
    """The LM of ``pattern`` with every section at its tiny sizes for n = 4 (``short_sections``:
    chunks and mini-batches of 4, windows of 5)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, d_model=32, n_heads=2, n_layers=n_layers or len(pattern),
                      layer_pattern=list(pattern), **kw)
    return LM(short_sections(cfg, 4)).to(dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_matches_forward(kind):
    """Token-by-token decoding with caches gives the logits of one full forward pass, for a
    stack of this mixer and global attention (float64; rounding-level 1e-8)."""
    m = tiny_lm([kind, GLOBAL]).eval()
    ids = torch.randint(0, 61, (2, 13))
    with torch.no_grad():
        full = m(ids).logits
        st = m.init_states(2, dtype=torch.float64)
        steps = []
        for t in range(ids.shape[1]):
            lg, st = m.step(ids[:, t], st)
            steps.append(lg)
    torch.testing.assert_close(torch.stack(steps, 1), full, atol=1e-8, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_lm_causal_and_reference(kind):
    m = tiny_lm([kind, WINDOWED]).eval()
    ids = torch.randint(0, 61, (1, 14))
    ids2 = ids.clone()
    ids2[:, 9:] = (ids2[:, 9:] + 1) % 61
    with torch.no_grad():
        a, b = m(ids).logits, m(ids2).logits
        ref = m.set_impl("reference")(ids).logits
        m.set_impl("chunked")
    torch.testing.assert_close(a[:, :9], b[:, :9], atol=1e-10, rtol=0)
    torch.testing.assert_close(ref, a, atol=1e-8, rtol=0)


def test_generate_is_deterministic_and_greedy_matches_argmax():
    m = tiny_lm([GLOBAL, WINDOWED]).eval()
    p = torch.randint(0, 61, (2, 4))
    g = m.generate(p, 6, temperature=0)
    assert g.shape == (2, 10) and torch.equal(g[:, :4], p)
    # greedy: each new token is the argmax of the full forward on the prefix
    with torch.no_grad():
        for t in range(4, 10):
            assert torch.equal(m(g[:, :t]).logits[:, -1].argmax(-1), g[:, t])
    gen = torch.Generator().manual_seed(0)
    s1 = m.generate(p, 5, temperature=1.0, top_k=5, generator=gen)
    gen.manual_seed(0)
    s2 = m.generate(p, 5, temperature=1.0, top_k=5, generator=gen)
    assert torch.equal(s1, s2)


@pytest.mark.slow
@pytest.mark.parametrize("pattern", [[GLOBAL], list(preset_config().layer_pattern)], ids=["global", "preset"])
def test_tiny_model_overfits_short_sequence(pattern):
    """A 2-layer model memorizes one 48-token sequence: loss falls from ≈ ln(61) ≈ 4.1 to < 0.3."""
    torch.manual_seed(0)
    m = tiny_lm(pattern, n_layers=2, dtype=torch.float32)
    ids = torch.randint(0, 61, (1, 49))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(150):
        loss = m(ids[:, :-1], labels=ids[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.3, loss.item()


def test_tied_embeddings_and_depth_scaled_init():
    """Tied head; the mixer's projections N(0, 0.02), those into the residual stream
    (``_is_residual_out``) N(0, 0.02/√(2·8)) (over 1k weights each: ±20% is ~10 standard errors)."""
    m = tiny_lm([GLOBAL], n_layers=8, dtype=torch.float32)
    assert m.lm_head.weight is m.embed.weight
    lin = [x for x in m.layers[0].mixer.modules() if isinstance(x, torch.nn.Linear) and x.weight.numel() >= 1024]
    outs = [x.weight.std().item() for x in lin if getattr(x, "_is_residual_out", False)]
    ins = [x.weight.std().item() for x in lin if not getattr(x, "_is_residual_out", False)]
    assert outs and ins
    assert all(abs(q - 0.02) < 0.004 for q in ins) and all(abs(o - 0.02 / 4.0) < 0.001 for o in outs), (ins, outs)
    untied = LM(ModelConfig(vocab_size=61, d_model=32, n_heads=2, n_layers=1, layer_pattern=[GLOBAL],
                            tie_embeddings=False))
    assert untied.lm_head.weight is not untied.embed.weight
    assert untied.num_params() - untied.num_params(exclude_embeddings=True) == 2 * 61 * 32


PRESETS = sorted(p for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml"))
                 if re.search(r"_(\d+m|\d+(\.\d+)?b)\.yaml$", p)
                 and model_class(load_config(p).model).size_names_count_params)


@pytest.mark.parametrize("path", PRESETS, ids=[os.path.basename(p) for p in PRESETS])
def test_preset_parameter_count_within_5_percent(path):
    size = re.search(r"_(\d+(?:\.\d+)?)(m|b)\.yaml$", path)
    nominal = float(size.group(1)) * (1e6 if size.group(2) == "m" else 1e9)
    n = param_counts(load_config(path).model)["total"]
    assert abs(n - nominal) / nominal < 0.05, f"{os.path.basename(path)}: {n / 1e6:.1f}M vs nominal {nominal / 1e6:.0f}M"


@pytest.mark.parametrize("kind", KINDS)
def test_reset_at_doc_boundaries_equals_separate_documents(kind):
    """With resets, a row packing documents [a | b | c] gives, on each document, the logits of that
    document run alone; without resets, later documents see earlier ones."""
    m = tiny_lm([kind, GLOBAL], reset_at_doc_boundaries=True).eval()
    lens = [5, 7, 3]
    docs = [torch.randint(0, 61, (1, n)) for n in lens]
    ids = torch.cat(docs, 1)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    with torch.no_grad():
        packed = m(torch.cat([ids, ids.flip(1)]), position_ids=torch.cat([pos, pos.flip(1) * 0 + pos]))
        alone = [m(d).logits for d in docs]
        plain = m(ids).logits
    torch.testing.assert_close(packed.logits[:1], torch.cat(alone, 1), atol=1e-10, rtol=0)
    assert (plain[:, 5:] - torch.cat(alone[1:], 1)).abs().max() > 1e-6


def test_reset_needs_the_flag_and_refuses_states():
    m = tiny_lm([GLOBAL]).eval()
    ids = torch.randint(0, 61, (1, 8))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(m(ids, position_ids=pos).logits, m(ids).logits)   # flag off: ignored
        m.cfg.reset_at_doc_boundaries = True
        with pytest.raises(ValueError, match="carried states"):
            m(ids, position_ids=pos, output_states=True)
