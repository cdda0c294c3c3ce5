"""TTT's packed documents beyond the shared checks of ``test_packed_docs.py``: the Mamba-backbone
variant (block pre-conv, shared-QK convolutions, output gate) restarts at document starts."""
import pytest
import torch

from ttt_lm.model import LM, ModelConfig
from tests.model.packed_checks import V, packed_equals_alone


@pytest.mark.parametrize("kind", ["ttt_linear", "ttt_mlp"])
def test_ttt_mamba_backbone_restarts(kind):
    """TTT's block pre-conv and its shared-QK convolutions (the Mamba backbone) restart at
    document starts too, in the mini-batch-aligned PyTorch form; gradients included. float64: some
    gradients here (learnable_token_idx) are sums that cancel to ~1e-6, below fp32's resolution
    of a relative check, so exactness is checked at 1e-9 in double precision."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, d_model=16, n_heads=2, n_layers=1, layer_pattern=[kind],
                      reset_at_doc_boundaries=True)
    cfg.ttt.mini_batch_size = 4
    cfg.ttt.pre_conv = cfg.ttt.share_qk = cfg.ttt.use_gate = True
    m = LM(cfg).double()
    assert m.layers[0].pre_conv is not None and m.layers[0].mixer.share_qk
    packed_equals_alone(m, 1e-9)
