"""The training processes do not print torch's FutureWarnings for the collectives DeepSpeed's ZeRO
optimizer calls (``all_gather_into_tensor``, ``reduce_scatter_tensor``: inside DeepSpeed, twice per
rank with a stray source line); every other warning still prints."""
import warnings

import torch
import torch.distributed as tdist

from ttt_lm.train.dist import quiet_deprecated_collectives


def _warnings_of(call):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        quiet = call is not None
        if quiet:
            quiet_deprecated_collectives()
        for fn in (tdist.all_gather_into_tensor, tdist.reduce_scatter_tensor):
            try:            # no process group: torch warns, then refuses the call
                fn(torch.zeros(1), torch.zeros(1))
            except Exception:
                pass
        warnings.warn("some other deprecation", FutureWarning)
        return [str(w.message) for w in got]


def test_the_deprecated_collectives_are_quiet_and_other_warnings_are_not():
    loud = _warnings_of(None)
    assert any("all_gather_into_tensor" in m for m in loud) and any("reduce_scatter_tensor" in m for m in loud)
    quiet = _warnings_of(True)
    assert quiet == ["some other deprecation"], quiet
