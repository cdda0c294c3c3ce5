"""The typed decode states (``MixerState`` and each mixer's subclass): map / to / detach /
index_select on every built-in kind (and each variant its class declares), at the tiny sizes its
section declares (``short_cases`` with n = 2: chunks of 2, windows of 3, so that 6 tokens cross
them). Reordering a batch's state and then stepping equals stepping the reordered inputs from
the start, as beam search needs. float64 throughout: a row's result does not depend on the other
rows, so the comparisons are exact up to 1e-12. A kind's own state checks (its options, its
buffers) are in its own test file."""
import pytest
import torch

from tests.model.mixer_checks import check_map_to_detach, check_reorder_then_step, make_mixer, short_cases
from ttt_lm.model import registry

CASES = short_cases(2, vocab_size=64, d_model=32)
IDS = [k if v is None else f"{k}-{v}" for k, v, _ in CASES]


@pytest.mark.parametrize("kind,variant,cfg", CASES, ids=IDS)
def test_reorder_then_step_equals_stepping_reordered_inputs(kind, variant, cfg):
    m, _ = make_mixer(kind, cfg=cfg)
    check_reorder_then_step(m)


@pytest.mark.parametrize("kind,variant,cfg", CASES, ids=IDS)
def test_map_to_and_detach_keep_the_type_and_the_fields(kind, variant, cfg):
    m, _ = make_mixer(kind, cfg=cfg)
    check_map_to_detach(m)


def test_index_select_refuses_a_non_vector_index():
    m, _ = make_mixer(registry.builtin_kinds()[0])
    st = m.init_state(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="1-D index of batch rows"):
        st.index_select(torch.tensor([[0, 1]]))
