r"""The chunked (state-space dual) form of Mamba-2's SSD in PyTorch (Dao & Gu 2024, "Transformers are
SSMs", §6, Listing 1; mamba_ssm's ``ssd_minimal_discrete`` is the same algorithm).

Per head, with log decays α_t = Δ_t A ≤ 0, split the sequence into chunks of Q tokens. Inside a
chunk that starts from state S, let the segment sums be

    σ(l, s) = Σ_{s < r ≤ l} α_r    (s ≤ l; −∞ above the diagonal),     γ_l = Σ_{r ≤ l} α_r

(positions local to the chunk). Unrolling S_t = e^{α_t} S_{t−1} + Δ_t x_t B_tᵀ gives four matrix
products per chunk:

    Y_diag = (C Bᵀ ∘ e^{σ}) (Δ ∘ X)                    the chunk's own tokens (a masked "attention")
    S_loc  = Σ_s e^{σ(Q−1, s)} Δ_s x_s B_sᵀ             what the chunk adds to the state
    S_next = e^{γ_{Q−1}} S + S_loc                       the state passed to the next chunk
    Y_off  = diag(e^{γ}) C Sᵀ                            the entering state read by every token

and y = Y_diag + Y_off. The entering states come from a loop over the chunks (T / Q steps of
[b, h, p, n] tensors, each chunk's tensors split once before it and stacked once after, so that the
backward of the loop writes no full-length gradient per chunk); mamba_ssm's minimal form computes
them instead with one more segment-sum matrix over the chunks, quadratic in their count.

Stability. Every exponential is of a segment sum σ(l, s) ≤ 0 or a prefix sum γ_l ≤ 0 of the log
decays, so nothing overflows whatever the decay: at Δ A = −70 per token a chunk of 256 sums to
−17920, and e^{σ} underflows to 0 where the true value is below the smallest float. The naive
factorization e^{γ_l} e^{−γ_s} would need e^{+17920}. σ is taken as mamba_ssm's stable ``segsum``
does: the decays repeated over a [Q, Q] matrix, masked below the diagonal and summed along it, so
σ(l, s) is a sum of the l − s terms between s and l, not a difference of two long prefix sums
(which would cancel: at |γ| ≈ 256 one float32 ulp is 3·10⁻⁵).

Packed sequences (``cu_seqlens``, b = 1), in the same pass: σ is set to −∞ between tokens of
different sequences; the entering state reaches a token only when its sequence began before the
chunk, and survives the chunk only when no sequence starts in it; a sequence starting inside chunk
c at position a contributes its initial state h₀ through the same segment sums,
e^{σ(l, a) + α_a} C_l h₀ to its tokens l of the chunk and e^{σ(Q−1, a) + α_a} h₀ to the state
leaving it (zero unless the sequence outlasts the chunk); the final state of a sequence ending at
position e of chunk c is e^{γ_e} S_c (if it began before c) + Σ_s e^{σ(e, s)} Δ_s x_s B_sᵀ (+ its
initial state's term when it began in c), one product per sequence. A ragged tail is padded with
Δ = 0 (decay 1, no input), which leaves the state unchanged. Gradients come from autograd.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from kernels.ssd.reference import acc_dtype, discretize, skip_and_gate
from kernels.ssd.shapes import check_cu_seqlens, check_ssd_inputs


def segsum(a: torch.Tensor) -> torch.Tensor:
    """σ [..., Q, Q] of log decays a [..., Q]: σ(l, s) = Σ_{s < r ≤ l} a_r for s ≤ l and −∞ above
    the diagonal, each entry a sum of its own terms (module docstring)."""
    Q = a.shape[-1]
    strict = torch.ones(Q, Q, dtype=torch.bool, device=a.device).tril(-1)
    s = a[..., :, None].expand(*a.shape, Q).masked_fill(~strict, 0.0).cumsum(-2)
    return s.masked_fill(~strict.logical_or(torch.eye(Q, dtype=torch.bool, device=a.device)), float("-inf"))


def _pick(t: torch.Tensor, chunk: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """t [..., Nc, Q, R] → [..., K, R]: row ``row[k]`` of chunk ``chunk[k]``."""
    t = t.index_select(-3, chunk)
    idx = row.view(-1, 1, 1).expand(*t.shape[:-2], 1, t.shape[-1])
    return t.gather(-2, idx).squeeze(-2)


def ssd_chunk_torch(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None,
                    dt_bias: Optional[torch.Tensor] = None, dt_softplus: bool = False,
                    initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                    chunk_size: int = 256, cu_seqlens: Optional[torch.Tensor] = None
                    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The chunked form (module docstring); arguments and results as ``kernels.ssd.ssd``. Chunks of
    ``chunk_size`` tokens (of T where T is shorter); the result does not depend on it."""
    check_ssd_inputs("ssd_chunk_torch", x, dt, A, B, C, D, z, dt_bias, initial_state, chunk_size, cu_seqlens)
    b, T, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    hg = h // g
    dtype = acc_dtype(x)
    cu: Optional[List[int]] = None if cu_seqlens is None else check_cu_seqlens("ssd_chunk_torch", cu_seqlens, T)
    N = b if cu is None else len(cu) - 1
    h0 = None if initial_state is None else initial_state.to(dtype)
    xs = x.to(dtype)
    if T == 0:
        final = (h0 if h0 is not None else xs.new_zeros(N, h, p, n)) if output_final_state else None
        return x.new_zeros(b, 0, h, p), final
    dev = x.device
    delta = discretize(dt, dt_bias, dt_softplus, dtype)
    Q = min(chunk_size, T)
    pad = (-T) % Q
    Nc = (T + pad) // Q
    Xd = F.pad(xs * delta[..., None], (0, 0, 0, 0, 0, pad)).view(b, Nc, Q, g, hg, p)     # Δ ∘ x
    Bc = F.pad(B.to(dtype), (0, 0, 0, 0, 0, pad)).view(b, Nc, Q, g, n)
    Cc = F.pad(C.to(dtype), (0, 0, 0, 0, 0, pad)).view(b, Nc, Q, g, n)
    a = F.pad(delta * A.to(dtype), (0, 0, 0, pad)).view(b, Nc, Q, g, hg).permute(0, 3, 4, 1, 2)  # α [b, g, hg, Nc, Q]

    sig = segsum(a)                                                         # σ [b, g, hg, Nc, Q, Q]
    if cu is not None:
        lens = torch.tensor([e - s for s, e in zip(cu, cu[1:])], device=dev)
        ids = torch.repeat_interleave(torch.arange(N, device=dev), lens)   # the sequence of each token
        ids = torch.cat([ids, ids[-1:].expand(pad)]).view(Nc, Q)          # the tail pads the last one
        enter = torch.cat([ids.new_full((1,), -1), ids[:-1, -1]])         # the sequence entering chunk c
        sig = sig.masked_fill(ids[:, :, None] != ids[:, None, :], float("-inf"))
    L = sig.exp()
    gam = a.cumsum(-1)                                                      # γ [b, g, hg, Nc, Q]
    to_bcl = (0, 3, 4, 1, 2)                                                # [b, g, hg, Nc, Q] → [b, Nc, Q, g, hg]

    CB = torch.einsum("bclgn,bcsgn->bgcls", Cc, Bc)
    Y = torch.einsum("bgjcls,bcsgjp->bclgjp", CB[:, :, None] * L, Xd)       # Y_diag
    S_loc = torch.einsum("bcsgjp,bcsgn->bcgjpn", Xd * L[..., -1, :].permute(to_bcl)[..., None], Bc)
    chunk_decay = gam[..., -1].exp()                                        # e^{γ_{Q−1}} [b, g, hg, Nc]
    read = gam.exp()                                                        # e^{γ_l}
    if cu is None:
        S = h0.view(b, g, hg, p, n) if h0 is not None else xs.new_zeros(b, g, hg, p, n)
    else:
        carry = ids == enter[:, None]                                       # [Nc, Q]
        chunk_decay = chunk_decay * (ids[:, -1] == enter)
        read = read * carry
        S = xs.new_zeros(1, g, hg, p, n)
        starts = [k for k in range(N) if cu[k + 1] > cu[k]]
        nz = torch.tensor(starts, device=dev, dtype=torch.long)
        a_pos = torch.tensor([cu[k] for k in starts], device=dev)
        e_pos = torch.tensor([cu[k + 1] - 1 for k in starts], device=dev)
        ca, la, ce, le = a_pos // Q, a_pos % Q, e_pos // Q, e_pos % Q
        if h0 is not None:
            h0k = h0.index_select(0, nz).view(-1, g, hg, p, n)
            # e^{σ(l, a) + α_a} for the tokens l of each sequence's first chunk: [b, g, hg, K, Q]
            col = _pick(sig.transpose(-1, -2), ca, la) + _pick(a[..., None], ca, la)
            u = col.exp().permute(to_bcl)                                   # [1, K, Q, g, hg]
            Z = torch.einsum("klgn,kgjpn->klgjp", Cc[0].index_select(0, ca), h0k) * u[0][..., None]
            Y = Y.index_add(1, ca, Z[None])
            inj = u[0, :, -1][..., None, None] * h0k                        # into the state leaving it
            S_loc = S_loc.index_add(1, ca, inj[None])

    entering = []
    for S_c, d_c in zip(S_loc.unbind(1), chunk_decay.unbind(-1)):
        entering.append(S)
        S = d_c[..., None, None] * S + S_c
    Sent = torch.stack(entering, 1)                                         # [b, Nc, g, hg, p, n]
    Y = Y + torch.einsum("bclgn,bcgjpn->bclgjp", Cc, Sent) * read.permute(to_bcl)[..., None]
    y = skip_and_gate(Y.reshape(b, Nc * Q, h, p)[:, :T], xs, D, z).to(x.dtype)
    if not output_final_state:
        return y, None
    if cu is None:
        return y, S.reshape(b, h, p, n)

    # the state after each sequence's last token e (chunk ce): [K, g, hg, p, n]
    w = _pick(L, ce, le)[0].permute(2, 3, 0, 1)                              # e^{σ(e, s)} [K, Q, g, hg]
    fin = torch.einsum("ksgjp,ksgn->kgjpn", Xd[0].index_select(0, ce) * w[..., None], Bc[0].index_select(0, ce))
    reach = _pick(read[..., None], ce, le)[0, ..., 0].permute(2, 0, 1)       # carry · e^{γ_e} [K, g, hg]
    fin = fin + reach[..., None, None] * Sent[0].index_select(0, ce)
    base = h0 if h0 is not None else xs.new_zeros(N, h, p, n)
    if h0 is not None:
        e_in = _pick(sig, ce, le).gather(-1, la.view(1, 1, 1, -1, 1).expand(1, g, hg, -1, 1))[..., 0]
        e_in = torch.where(ca == ce, (e_in + _pick(a[..., None], ca, la)[..., 0]).exp(), 0.0)
        fin = fin + e_in[0].permute(2, 0, 1)[..., None, None] * h0k
    return y, base.index_copy(0, nz, fin.reshape(-1, h, p, n))


__all__ = ["ssd_chunk_torch", "segsum"]
