"""model.init for Griffin: the griffin scheme follows recurrentgemma.

Standard deviations are estimated over ≥ 16k weights, so a relative error of 5% is ~6 standard
errors of the estimate; the alternatives the tests tell apart differ by ≥ 40%."""
import math
import torch

from tests.model.test_init import _close, _lm, _std


def test_griffin_scheme_follows_recurrentgemma():
    """recurrentgemma: N(0, 1/fan_in), out projections N(0, (2/L)/fan_in): linear_x, linear_y
    N(0, 1/width), linear_out N(0, (2/L)/lru_width), attention q/k/v N(0, 1/width) and o
    N(0, (2/L)/width), MLP up N(0, 1/width) and down N(0, (2/L)/d_ff); biases 0."""
    L, d, lru, ff = 3, 128, 192, 384
    m = _lm(["rglru", "rglru", "local_attention"], "griffin", n_layers=L, d_ff=ff, rglru={"lru_width": lru},
            attention={"num_kv_heads": 1})
    r, a = m.layers[0].mixer, m.layers[2].mixer
    _close(_std(r.linear_x.weight), 1 / math.sqrt(d))
    _close(_std(r.linear_y.weight), 1 / math.sqrt(d))
    _close(_std(r.linear_out.weight), math.sqrt(2 / L / lru))
    assert r.linear_x.bias.abs().max() == 0 and r.linear_out.bias.abs().max() == 0
    _close(_std(a.q_proj.weight), 1 / math.sqrt(d))
    _close(_std(a.o_proj.weight), math.sqrt(2 / L / d))
    _close(_std(m.layers[1].mlp.up_proj.weight), 1 / math.sqrt(d))
    _close(_std(m.layers[1].mlp.down_proj.weight), math.sqrt(2 / L / ff))
    # the RG-LRU's own parameters keep their official init under every scheme
    a_sq = torch.sigmoid(r.Lambda.detach().double()) ** 2
    assert 0.81 - 1e-6 <= float(a_sq.min()) and float(a_sq.max()) <= 0.999 ** 2 + 1e-6
