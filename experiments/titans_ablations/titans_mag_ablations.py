"""Titans MAG on induction with its memory gate taken away: a control for the MAC ablations.

    PYTHONPATH=. OMP_NUM_THREADS=1 python experiments/titans_ablations/titans_mag_ablations.py VARIANT SEED LR STEPS

MAG's output, W_O [RMSNorm(W_O^attn SWA(x)) ⊙ σ(RMSNorm(M(x)))], has the two trained projections in
series that kept MAC as it was at commit 6aa8fd0 at chance (``titans_mac_ablations.py``). This trains
``titans_mag`` exactly as ``python -m ttt_lm.eval synthetic --task induction --mixers titans_mag
--train-len 64 --test-lens 64,256 --stop-at 0.98`` does (``run_synthetic``), with ``TitansMAG``
patched in this process only, and prints one JSON line (with the commit it ran at). VARIANT:

- ``full``: MAG unchanged
- ``nogate``: o = W_O RMSNorm(W_O^attn SWA(x)), the memory's gate σ(RMSNorm(M(x))) dropped: the
  function family of MAC's ``nogate,noh,nopersist`` ablation (at length 64 the window, 256, and
  MAC's segment, 64, both cover the whole sequence)
- ``ygate``: the gate kept, but its memory reads the attention's output y instead of x,
  o = W_O [RMSNorm(y) ⊙ σ(RMSNorm(M(y)))]: the gate's input as in MAC (where M*(y) is the memory
  updated on y up to each token, as the LMM over y computes it here too)

Results are appended by hand to ``titans_mac_ablations.jsonl`` (``"mixer": "titans_mag"``).
"""
import json
import os
import subprocess
import sys
import time

import torch

from ttt_lm.eval import synthetic as S
from ttt_lm.model.mixers import titans as T

if len(sys.argv) != 5 or sys.argv[1] in ("-h", "--help"):
    print(__doc__)
    sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
variant, seed, lr, steps = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
if variant not in ("full", "nogate", "ygate"):
    sys.exit(f"unknown variant {variant!r}; known: full, nogate, ygate")
torch.set_num_threads(1)
if variant == "nogate":
    def output(self, ym, x):
        return self.o_proj(self.attn_norm(ym[0]))
    T.TitansMAG.output = output
if variant == "ygate":
    def op(self, inp, initial_state=None, output_final_state=False, backend="torch"):
        """``TitansMAG.op`` with the memory run over the attention's output y instead of x."""
        x = inp["x"]
        sa, sm = (None, None) if initial_state is None else initial_state
        self.attn.kernel_backend = self.memory.kernel_backend = self.kernel_backend
        attn = self.attn.reference if backend == T.Backend.REFERENCE else self.attn.chunked
        y, sa = attn(x, sa, output_final_state)
        m, sm = self.memory._run(y, sm, output_final_state, backend)
        return (y, m), ((sa, sm) if output_final_state else None)
    T.TitansMAG.op = op

t0 = time.time()
r = S.run_synthetic(S.make_task("induction"), "titans_mag", 64, [64, 256], steps, lr=lr, seed=seed, stop_at=0.98)
code = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True,
                      cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
print(json.dumps({"code": code, "mixer": "titans_mag", "variant": [variant], "seed": seed, "lr": lr, "budget": steps,
                  "steps_to_solve": r.steps_to_solve, "loss": r.final_train_loss, "acc": r.accuracy,
                  "seconds": round(time.time() - t0, 1)}))
