"""model.init for Mamba: the mamba scheme follows mamba_ssm.

Standard deviations are estimated over ≥ 16k weights, so a relative error of 5% is ~6 standard
errors of the estimate; the alternatives the tests tell apart differ by ≥ 40%."""
import math

import pytest
import torch

from tests.model.test_init import _close, _lm, _std


@pytest.mark.parametrize("d_ff,n_res", [(0, 1), (None, 2)])
def test_mamba_scheme_follows_mamba_ssm(d_ff, n_res):
    """mamba_ssm: linears keep PyTorch's kaiming-uniform (a = √5: U(±1/√fan_in), std
    1/√(3 fan_in)), out_proj that divided by √(n_residuals_per_layer · L) (1 without an MLP, 2
    with one); dt_proj, A_log, D keep Mamba's own init."""
    L, d = 4, 128
    m = _lm(["mamba"], "mamba", n_layers=L, d_ff=d_ff)
    mx = m.layers[0].mixer
    fan = d
    assert float(mx.in_proj.weight.detach().abs().max()) <= 1 / math.sqrt(fan)
    _close(_std(mx.in_proj.weight), 1 / math.sqrt(3 * fan))
    fan_out_proj = mx.d_inner
    _close(_std(mx.out_proj.weight), 1 / math.sqrt(3 * fan_out_proj) / math.sqrt(n_res * L))
    r = mx.dt_rank ** -0.5
    assert float(mx.dt_proj.weight.detach().abs().max()) <= r and float(mx.dt_proj.bias.detach().abs().max()) > 0
    torch.testing.assert_close(mx.A_log[0].detach().exp(), torch.arange(1, 17, dtype=torch.float32))
