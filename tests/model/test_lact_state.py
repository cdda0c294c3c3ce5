"""LaCT's decode state beyond the shared checks of ``test_mixer_state.py``: low-rank fast weights
with Muon in the state's dtype."""
import pytest

from tests.model.mixer_checks import check_map_to_detach, check_reorder_then_step, make_mixer

LOW_RANK_MUON = {"lact": {"chunk_size": 2, "window": 3, "num_heads": 2, "low_rank": 2, "use_muon": True,
                          "muon_dtype": "state"}}


@pytest.mark.parametrize("check", [check_reorder_then_step, check_map_to_detach],
                         ids=["reorder_then_step", "map_to_detach"])
def test_lact_low_rank_muon_state(check):
    m, _ = make_mixer("lact", **LOW_RANK_MUON)
    check(m)
