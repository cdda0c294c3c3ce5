"""Titans MAC on induction with parts of it taken away, to find what keeps it from learning the task.

    PYTHONPATH=. OMP_NUM_THREADS=1 python experiments/titans_ablations/titans_mac_ablations.py VARIANTS SEED LR STEPS

Trains ``titans_mac`` exactly as ``python -m ttt_lm.eval synthetic --task induction --mixers titans_mac
--train-len 64 --test-lens 64,256 --stop-at 0.98`` does (``run_synthetic``: same tiny model, data,
schedule, criterion), with ``TitansMAC`` patched in this process only, and prints one JSON line.
VARIANTS is a comma-joined set of the following. The rows of ``titans_mac_ablations.jsonl`` marked
``"code": "6aa8fd0"`` ran against MAC as it was at commit 6aa8fd0, with a second trained W_O after
the gate, o = W_O [RMSNorm(y) ⊙ σ(RMSNorm(m))]; to rerun them, check that commit out. Since then
MAC's output is the gate alone (the ``nofinalout`` form below, which ``full`` now is), and the
variants act on that form; each new row records the commit it ran at.

- ``noh``: no retrieval keys h (attention over [p ‖ S] only)
- ``nopersist``: no persistent tokens (N_p = 0)
- ``nogate``: o = W_O RMSNorm(y) (the memory's σ(RMSNorm(m)) gate dropped)
- ``nonorm``: no RMSNorm on y in the output (o = W_O [y ⊙ gate])
- ``single``: o = y, the attention's own W_O output alone (no gate, no norm, no second projection),
  that W_O drawn with plain attention's depth-scaled std; with ``noh,nopersist`` this is plain
  attention's function
- ``noattnout``: the attention's own W_O removed (identity), so the gate's W_O is the one output
  projection; everything else of MAC kept
- ``eyeinit``: MAC unchanged but for the attention's own W_O starting at the identity, so that at
  initialization the output is the one-projection form of ``noattnout``, and that W_O still trains
- ``nofinalout``: the gate's W_O removed, o = RMSNorm(y) ⊙ σ(RMSNorm(m)) as the paper's Eq. 25
  (o = y ⊗ M*(y)) writes it, so the attention's own W_O is the one output projection (MAC has
  this form since 6aa8fd0's successor: a no-op there)
- ``full``: MAC unchanged

The results are in ``titans_mac_ablations.jsonl`` beside this file (one line per run, appended by
hand); ``docs/results/titans_mac.md`` tabulates them.
"""
import json
import math
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from ttt_lm.eval import synthetic as S
from ttt_lm.model import LM
from ttt_lm.model.mixers import titans as T

if len(sys.argv) != 5 or sys.argv[1] in ("-h", "--help"):
    print(__doc__)
    sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
variant, seed, lr, steps = sys.argv[1].split(","), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
known = {"noh", "nopersist", "nogate", "nonorm", "single", "noattnout", "eyeinit", "nofinalout", "full"}
if not set(variant) <= known:
    sys.exit(f"unknown variants {sorted(set(variant) - known)}; known: {sorted(known)}")
torch.set_num_threads(1)
Mac = T.TitansMAC

if "single" in variant:
    def output(self, ym, x):
        return ym[0]
    Mac.output = output
elif "nogate" in variant or "nonorm" in variant or "nofinalout" in variant:
    def output(self, ym, x):
        y, m = ym
        yy = y if "nonorm" in variant else self.attn_norm(y)
        g = 1.0 if "nogate" in variant else torch.sigmoid(self.mem_norm(m))
        return self.o_proj(yy * g) if hasattr(self, "o_proj") and "nofinalout" not in variant else yy * g
    Mac.output = output

if "noh" in variant:
    def segment_attention_without_h(self, full, h, n_old, backend):
        """Attn(p ‖ S) at the positions of S[n_old:]: ``_segment_attention`` without the h keys."""
        a = self.attn
        B, L, D = full.shape
        Np, Tq = self.n_persist, L - n_old
        ext = torch.cat([self.persistent.to(full.dtype).expand(B, -1, -1), full], 1)
        q = a.q_proj(full[:, n_old:]).view(B, Tq, a.n_heads, a.hd).transpose(1, 2)
        k = a.k_proj(ext).view(B, -1, a.n_kv, a.hd).transpose(1, 2)
        v = a.v_proj(ext).view(B, -1, a.n_kv, a.hd).transpose(1, 2)
        seg_pos = Np + torch.arange(L)
        cq, sq = T.rope_cos_sin(seg_pos[n_old:], a.hd, a.rope_theta)
        ck, sk = T.rope_cos_sin(torch.cat([torch.arange(Np), seg_pos]), a.hd, a.rope_theta)
        q, k = T.apply_rope(q, cq, sq), T.apply_rope(k, ck, sk)
        j, jk = torch.arange(n_old, L)[:, None], torch.arange(L)[None, :]
        mask = torch.cat([torch.ones(Tq, Np, dtype=torch.bool), jk <= j], 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return a.o_proj(o.transpose(1, 2).reshape(B, Tq, a.n_heads * a.hd))
    Mac._segment_attention = segment_attention_without_h


def build(pattern, vocab_size, **kw):
    torch.manual_seed(kw.get("seed", 0))
    cfg = S.ModelConfig(vocab_size=vocab_size, d_model=kw.get("d_model", 64), n_layers=kw.get("n_layers", 2),
                        n_heads=kw.get("n_heads", 2), layer_pattern=list(pattern),
                        max_seq_len=kw.get("max_seq_len", 4096), tie_embeddings=True)
    cfg.titans.chunk_size = 16
    if "nopersist" in variant:
        cfg.titans.persistent_tokens = 0
    m = LM(cfg)
    with torch.no_grad():
        for blk in m.layers:
            if "single" in variant:   # the depth-scaled init plain attention's W_O gets
                blk.mixer.attn.o_proj.weight.normal_(0.0, 0.02 / math.sqrt(2 * cfg.n_layers))
            if "eyeinit" in variant:
                torch.nn.init.eye_(blk.mixer.attn.o_proj.weight)
            if "noattnout" in variant:
                blk.mixer.attn.o_proj = torch.nn.Identity()
    return m


S.build_tiny_lm = build
t0 = time.time()
r = S.run_synthetic(S.make_task("induction"), "titans_mac", 64, [64, 256], steps, lr=lr, seed=seed, stop_at=0.98)
code = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True,
                      cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
print(json.dumps({"code": code, "variant": variant, "seed": seed, "lr": lr, "budget": steps, "steps_to_solve": r.steps_to_solve,
                  "loss": r.final_train_loss, "acc": r.accuracy, "seconds": round(time.time() - t0, 1)}))
