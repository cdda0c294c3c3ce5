"""TTT's decode states beyond the shared checks of ``test_mixer_state.py``: TTT-MLP with shared
Q/K convolutions, and a whole model's states with TTT's block pre-conv cache."""
import dataclasses

import pytest
import torch

from tests.model.mixer_checks import check_map_to_detach, check_reorder_then_step, make_mixer, tiny_cfg
from ttt_lm.model import LM

SHARE_QK = {"ttt": {"mini_batch_size": 4, "share_qk": True}}


@pytest.mark.parametrize("check", [check_reorder_then_step, check_map_to_detach],
                         ids=["reorder_then_step", "map_to_detach"])
def test_ttt_mlp_share_qk_state(check):
    m, _ = make_mixer("ttt_mlp", **SHARE_QK)
    assert m.share_qk
    check(m)


def test_lm_states_reorder_with_the_pre_conv():
    """A whole model's states (block states with TTT's pre-conv cache, and an attention layer)."""
    cfg = dataclasses.replace(tiny_cfg("ttt_linear"), layer_pattern=["ttt_linear", "attention"], n_layers=2)
    cfg.ttt.pre_conv = True
    torch.manual_seed(0)
    lm = LM(cfg.validate()).double().eval()
    ids = torch.randint(0, 64, (3, 7))
    idx = torch.tensor([1, 2, 1])
    with torch.no_grad():
        states = lm(ids, output_states=True).states
        assert states[0].pre_conv is not None
        moved = [s.index_select(idx) for s in states]
        y, _ = lm.step(ids[idx, -1], moved)
        want = lm(torch.cat([ids[idx], ids[idx, -1:]], 1)).logits[:, -1]
    torch.testing.assert_close(y, want, atol=1e-10, rtol=0)
