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
them instead with one more segment-sum matrix over the chunks, quadratic in their count. Y_diag
and S_loc, whose [Q, Q] tensors are the bulk of the memory traffic, are computed a few chunks at a
time (``PIECE`` elements of those tensors per piece) so that they stay in cache forward and
backward; on a CPU that keeps the cost linear in T past the cache size.

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
initial state's term when it began in c), one product per sequence; the segment sums these
terms need are summed per sequence from the log decays of its first and last chunk. A ragged tail is padded with
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
    later = torch.ones(Q, Q, dtype=torch.bool, device=a.device).triu(1)     # [s, r]: r > s
    # t[s, l] = Σ_{r ≤ l, r > s} a_r, summed along the last (contiguous) dim, 2-3x faster on a CPU
    t = a[..., None, :].expand(*a.shape, Q).masked_fill(~later, 0.0).cumsum(-1)
    return t.transpose(-1, -2).masked_fill(later, float("-inf"))


#: elements of the [Q, Q] tensors of one piece of chunks (4 MiB in float32): the chunks' own tokens
#: are computed a few chunks at a time so that these tensors stay in cache, forward and backward
PIECE = 1 << 20


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
    to_bcl = (0, 3, 4, 1, 2)                                                # [b, g, hg, Nc, Q] → [b, Nc, Q, g, hg]


    same = None
    if cu is not None:
        lens = torch.tensor([e - s for s, e in zip(cu, cu[1:])], device=dev)
        ids = torch.repeat_interleave(torch.arange(N, device=dev), lens)   # the sequence of each token
        ids = torch.cat([ids, ids[-1:].expand(pad)]).view(Nc, Q)          # the tail pads the last one
        enter = torch.cat([ids.new_full((1,), -1), ids[:-1, -1]])         # the sequence entering chunk c
        same = ids[:, :, None] == ids[:, None, :]                          # [Nc, Q, Q]

    # the chunks' own tokens, a few chunks at a time (PIECE): Y_diag [b, Nc, Q, g, hg, p], S_loc
    step = max(1, PIECE // (b * h * Q * Q))
    parts = [_intra(*args) for args in zip(a.split(step, -2), Xd.split(step, 1), Bc.split(step, 1),
                                            Cc.split(step, 1), (same.split(step, 0) if same is not None
                                                                else [None] * -(-Nc // step)))]
    Y = torch.cat([y_ for y_, _ in parts], 1) if len(parts) > 1 else parts[0][0]
    S_loc = torch.cat([s_ for _, s_ in parts], 1) if len(parts) > 1 else parts[0][1]
    gam = a.cumsum(-1)                                                      # γ [b, g, hg, Nc, Q]
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
            # σ(l, a) + α_a over the tokens l of each sequence's first chunk: [b, g, hg, K, Q]
            col = _decay_from(a, ids, ca, la) + a.index_select(-2, ca).gather(-1, _idx(la, a))
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
    w = _decay_to(a, ids, ce, le).exp()[0].permute(2, 3, 0, 1)              # e^{σ(e, s)} [K, Q, g, hg]
    fin = torch.einsum("ksgjp,ksgn->kgjpn", Xd[0].index_select(0, ce) * w[..., None], Bc[0].index_select(0, ce))
    reach = read.index_select(-2, ce).gather(-1, _idx(le, a))[0, ..., 0].permute(2, 0, 1)  # carry · e^{γ_e}
    fin = fin + reach[..., None, None] * Sent[0].index_select(0, ce)
    base = h0 if h0 is not None else xs.new_zeros(N, h, p, n)
    if h0 is not None:                                                      # begun in the chunk where it ends
        e_in = torch.where(ca == ce, col.gather(-1, _idx(le, a))[..., 0].exp(), 0.0)
        fin = fin + e_in[0].permute(2, 0, 1)[..., None, None] * h0k
    return y, base.index_copy(0, nz, fin.reshape(-1, h, p, n))


def _intra(a, Xd, Bc, Cc, same):
    """Y_diag and S_loc of some chunks (module docstring): a [b, g, hg, c, Q], Xd [b, c, Q, g, hg, p],
    Bc, Cc [b, c, Q, g, n], same [c, Q, Q] (tokens of one sequence) or None."""
    sig = segsum(a)                                                         # σ [b, g, hg, c, Q, Q]
    if same is not None:
        sig = sig.masked_fill(~same, float("-inf"))
    L = sig.exp()
    CB = torch.einsum("bclgn,bcsgn->bgcls", Cc, Bc)
    Y = torch.einsum("bgjcls,bcsgjp->bclgjp", CB[:, :, None] * L, Xd)
    S_loc = torch.einsum("bcsgjp,bcsgn->bcgjpn", Xd * L[..., -1, :].permute(0, 3, 4, 1, 2)[..., None], Bc)
    return Y, S_loc


def _idx(pos: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """pos [K] as a gather index over the last dim of [b, g, hg, K, Q] tensors: [b, g, hg, K, 1]."""
    return pos.view(1, 1, 1, -1, 1).expand(*a.shape[:3], -1, 1)


def _decay_from(a: torch.Tensor, ids: torch.Tensor, chunk: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """σ(l, s_k) = Σ_{s_k < r ≤ l} α_r over the tokens l of chunk c_k (−∞ before s_k or in another
    sequence): a [b, g, hg, Nc, Q], ids [Nc, Q] → [b, g, hg, K, Q], a sum of its own terms."""
    Q = a.shape[-1]
    r = torch.arange(Q, device=a.device)
    ak = a.index_select(-2, chunk).masked_fill(r <= pos[:, None], 0.0)
    ik = ids.index_select(0, chunk)
    valid = (r >= pos[:, None]) & (ik == ik.gather(1, pos[:, None]))
    return ak.cumsum(-1).masked_fill(~valid, float("-inf"))


def _decay_to(a: torch.Tensor, ids: torch.Tensor, chunk: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """σ(e_k, s) = Σ_{s < r ≤ e_k} α_r over the tokens s of chunk c_k (−∞ after e_k or in another
    sequence): [b, g, hg, K, Q], a sum of its own terms."""
    Q = a.shape[-1]
    r = torch.arange(Q, device=a.device)
    ak = a.index_select(-2, chunk).masked_fill(r > pos[:, None], 0.0)
    tail = ak.flip(-1).cumsum(-1).flip(-1)                                  # Σ_{s ≤ r ≤ e}
    tail = torch.cat([tail[..., 1:], torch.zeros_like(tail[..., :1])], -1)  # Σ_{s < r ≤ e}
    ik = ids.index_select(0, chunk)
    valid = (r <= pos[:, None]) & (ik == ik.gather(1, pos[:, None]))
    return tail.masked_fill(~valid, float("-inf"))


__all__ = ["ssd_chunk_torch", "segsum"]
