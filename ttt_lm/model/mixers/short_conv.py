r"""The short convolutions before the delta rules' op, shared by Gated DeltaNet and KDA: causal
depthwise convolutions of width w over the q, k and v projections, each followed by SiLU
(flash-linear-attention's ``ShortConvolution`` with ``activation="silu"``),

    q̃ = SiLU(conv_q(W_q x)),   k̃ = SiLU(conv_k(W_k x)),   ṽ = SiLU(conv_v(W_v x)),

or the SiLU alone where the layer has none (w = 0). The decode cache is each conv's last w − 1
inputs (``conv_q``, ``conv_k``, ``conv_v`` of the mixer's state); context parallelism reads the
w − 1 tokens before a slice (``cp_halo``) and starts each conv from them (``context_state``);
packed documents mask the taps that reach into an earlier document (``doc_conv``).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from ttt_lm.model.docs import doc_conv
from ttt_lm.model.layers import CausalConv1d


class QKVShortConvs:
    """Mixin of a mixer whose state has the fields ``conv_q``, ``conv_k``, ``conv_v`` and ``pos``
    (``conv_state``: its state class) and whose projections are ``q_proj``, ``k_proj``, ``v_proj``."""

    #: the mixer's state class (a ``MixerState`` with conv_q, conv_k, conv_v and pos)
    conv_state: type

    def build_convs(self, key_dim: int, value_dim: int, width: int, bias: bool) -> None:
        """q_conv, k_conv [key_dim] and v_conv [value_dim] of ``width`` taps; None each for width 0."""
        self.q_conv = CausalConv1d(key_dim, width, bias=bias) if width > 0 else None
        self.k_conv = CausalConv1d(key_dim, width, bias=bias) if width > 0 else None
        self.v_conv = CausalConv1d(value_dim, width, bias=bias) if width > 0 else None

    @property
    def cp_halo(self) -> int:
        return 0 if self.q_conv is None else self.q_conv.width - 1

    def context_state(self, x_before, valid, start: int):
        if self.q_conv is None:
            return self.conv_state(pos=start)
        return self.conv_state(conv_q=self.q_conv.cache_from(self.q_proj(x_before), valid),
                               conv_k=self.k_conv.cache_from(self.k_proj(x_before), valid),
                               conv_v=self.v_conv.cache_from(self.v_proj(x_before), valid), pos=start)

    def _conv(self, conv, x, cache, docs=None):
        if conv is None:
            return F.silu(x), None
        if docs is not None:
            return F.silu(doc_conv(conv, x, docs, cache)), None
        y, new = conv(x, cache, output_cache=True)
        return F.silu(y), new

    def conv_qkv(self, x: torch.Tensor, st, docs=None) -> Tuple[Tuple[torch.Tensor, ...], Dict[str, Optional[torch.Tensor]]]:
        """(q̃, k̃, ṽ) [B, T, ·] from x [B, T, D] and the state's conv caches, and the new caches
        {conv_q, conv_k, conv_v} (None under ``docs``, or without convs)."""
        q, cq = self._conv(self.q_conv, self.q_proj(x), st.conv_q, docs)
        k, ck = self._conv(self.k_conv, self.k_proj(x), st.conv_k, docs)
        v, cv = self._conv(self.v_conv, self.v_proj(x), st.conv_v, docs)
        return (q, k, v), {"conv_q": cq, "conv_k": ck, "conv_v": cv}

    def init_conv_caches(self, batch_size: int, device=None, dtype=None) -> Dict[str, Optional[torch.Tensor]]:
        """The caches before the first token: {conv_q, conv_k, conv_v} (None without convs)."""
        return {n: None if c is None else c.init_cache(batch_size, device, dtype)
                for n, c in (("conv_q", self.q_conv), ("conv_k", self.k_conv), ("conv_v", self.v_conv))}


__all__ = ["QKVShortConvs"]
