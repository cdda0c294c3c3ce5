"""State passing with packed documents for TTT's pre-conv (``ttt.pre_conv``: the block runs a
causal conv over the residual stream before the mixer, so the state a rank hands on nests the
conv cache beside TTT's), against the single-process run, on CPU with gloo, with 2 and 4 ranks:
the positions, comparison and tolerance of test_cp_docs_state.py.

The spawns are those of test_cp_docs_state.py's kind: the tests are marked slow too."""
from __future__ import annotations

import pytest

from tests.distributed import assert_within, spawn_checks
from tests.parallel.test_context_parallel import _tiny_lm
from tests.parallel.test_cp_docs_state import TOL, check_block, check_lm


def _checks(rank, world):
    return {
        "block": lambda: check_block(rank, world, model=_tiny_lm(["ttt_linear"], pre_conv=True)),
        "block_chunks2": lambda: check_block(rank, world, chunks=2, model=_tiny_lm(["ttt_linear"], pre_conv=True)),
        # TTT with pre-convs beside a Titans layer (its MLP memory), pipelined over 2 row groups
        "lm_chunks2": lambda: check_lm(rank, world, 2, model=_tiny_lm(["ttt_mlp", "titans", "ttt_linear"],
                                                                      pre_conv=True)),
    }


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def results(request, tmp_path_factory):
    world = request.param
    res, err = spawn_checks(world, __name__, tmp_path_factory.mktemp(f"tttcpdocs{world}"), "_checks",
                            stop_on_failure=True, timeout_s=60)
    return world, res, err


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("name", ["block", "block_chunks2"])
def test_pre_conv_block_docs(results, name):
    """A TTT-Linear block with a pre-conv (its conv cache and TTT state handed on per row), in
    one row group and in 2."""
    assert_within(results, name, TOL)


@pytest.mark.dist
@pytest.mark.slow
def test_lm_docs_pre_conv(results):
    """``context_parallel_forward`` with document resets on an LM of TTT blocks with pre-convs and
    a Titans block, pipelined over 2 row groups: loss, logits, gradients."""
    assert_within(results, "lm_chunks2", TOL)
