r"""Chunk-parallel form of the Titans memory update (Behrouz et al. 2025, §3.2), in PyTorch.

Inside a chunk of C tokens starting from (M₀, S₀), every gradient is taken at one anchor, so the
gradients G_j are known up front and both recurrences are linear. With the within-chunk
cumulative products (computed as cumulative sums in log space)

    ā_i = Π_{l≤i} η_l,          b_t = Π_{l≤t} (1 − α_l),
    L_a[i, j] = ā_i / ā_j,       L_b[t, i] = b_t / b_i          (j ≤ i ≤ t, else 0)

unrolling S_i = η_i S_{i−1} − θ_i G_i and M_t = (1 − α_t) M_{t−1} + S_t gives

    S_i = ā_i S₀ − Σ_{j≤i} L_a[i, j] θ_j G_j
    M_t = b_t M₀ + c_t S₀ − Σ_{j≤t} D[t, j] θ_j G_j,      c = L_b ā,   D = L_b L_a.

Every gradient of a memory layer is rank one per token, G_j = x_jᵀ δ_j (x_j the layer's input at
the anchor, δ_j the loss's gradient at the layer's output), so reading the memory with a query z_t
never forms M_t:

    z_t M_t = b_t z_t M₀ + c_t z_t S₀ − Σ_j D[t, j] θ_j (z_t · x_j) δ_j,

which is linear attention with the decay mask D. ``chunk_memory_step`` does one chunk of one
memory layer; the linear memory uses it once per chunk (x = k, δ = 2(k M̂ − v), z = q), the MLP
memory of the Titans mixer twice.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from kernels.titans.reference import _acc, _initial, check_titans_inputs


def chunk_decays(theta: torch.Tensor, log_eta: torch.Tensor, log_keep: torch.Tensor) -> Dict[str, torch.Tensor]:
    """theta, log_eta, log_keep [..., C] for one chunk (or [..., N, C] for N chunks at once).
    Returns the coefficients of the unrolled chunk: Dθ[t, j] = D[t, j] θ_j, b_t, c_t, ā_C and
    the weights wS_j = (ā_C / ā_j) θ_j of each gradient in the chunk's final surprise."""
    C = theta.shape[-1]
    causal = torch.ones(C, C, dtype=torch.bool, device=theta.device).tril()
    # η = 0 or α = 1 (log = −inf) would give −inf − (−inf) = nan below; exp(−1e4) is already 0
    A = log_eta.clamp(min=-1e4).cumsum(-1)
    Bc = log_keep.clamp(min=-1e4).cumsum(-1)
    La = (A[..., :, None] - A[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    Lb = (Bc[..., :, None] - Bc[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    a = A.exp()
    return {
        "Dth": (Lb @ La) * theta[..., None, :],
        "b": Bc.exp(),
        "c": (Lb @ a[..., None])[..., 0],
        "a_end": a[..., -1],
        "wS": (A[..., -1:] - A).exp() * theta,
    }


def chunk_memory_step(M0: torch.Tensor, S0: torch.Tensor, X: torch.Tensor, delta: torch.Tensor,
                      Z: torch.Tensor, dec: Dict[str, torch.Tensor]
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of one memory layer. M0, S0 [B, H, d_in, d_out]; X, Z [B, H, C, d_in];
    delta [B, H, C, d_out]; dec from ``chunk_decays`` for this chunk ([B, H, C] entries).
    Returns (Y = [z_t M_t]_t [B, H, C, d_out], M_C, S_C)."""
    Dth, b, c = dec["Dth"], dec["b"], dec["c"]
    Y = (b[..., None] * (Z @ M0) + c[..., None] * (Z @ S0)
         - (Dth * (Z @ X.transpose(-1, -2))) @ delta)
    Xt = X.transpose(-1, -2)
    M_end = (b[..., -1, None, None] * M0 + c[..., -1, None, None] * S0
             - Xt @ (Dth[..., -1, :, None] * delta))
    S_end = dec["a_end"][..., None, None] * S0 - Xt @ (dec["wS"][..., None] * delta)
    return Y, M_end, S_end


def chunk_spans(T: int, chunk_size: int, offset: int = 0) -> List[Tuple[int, int]]:
    """[start, end) of each chunk of a call over T tokens whose first offset % C tokens of the
    first chunk were consumed before the call. The first and last spans may be short; they are
    processed at their own length rather than padded, because a padded token is not a no-op
    (M_t = (1 − α_t) M_{t−1} + S_t adds the momentum even when the token's gradient is zero)."""
    spans, t = [], 0
    first = (chunk_size - offset % chunk_size) % chunk_size
    if first:
        spans.append((0, min(first, T)))
        t = spans[-1][1]
    while t < T:
        spans.append((t, min(t + chunk_size, T)))
        t = spans[-1][1]
    return spans


def split_spans(spans: List[Tuple[int, int]], *xs: torch.Tensor, dim: int = 2) -> List[Tuple[torch.Tensor, ...]]:
    """Each tensor cut once along ``dim`` into the consecutive ``spans``: per span, the tuple of
    its pieces. One split per tensor is one autograd node whose backward concatenates the pieces'
    gradients; slicing inside the chunk loop instead writes a zero-filled gradient of the whole
    sequence per slice in backward, which grows quadratically with T."""
    sizes = [t1 - t0 for t0, t1 in spans]
    return list(zip(*(x.split(sizes, dim=dim) for x in xs))) if sizes else []


def titans_linear_chunk_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, theta: torch.Tensor,
                              log_eta: torch.Tensor, log_keep: torch.Tensor,
                              initial_state: Optional[Sequence[torch.Tensor]] = None,
                              output_final_state: bool = False, chunk_size: int = 16, offset: int = 0,
                              chunk_resets: Optional[torch.Tensor] = None):
    """``chunk_resets`` [B, ⌈T/C⌉] bool (offset 0): where True, chunk n of that row starts again
    from the initial (M, S) (a new sequence starts there; masked per row inside the one scan)."""
    check_titans_inputs("titans_linear_chunk_torch", q, k, v, theta, log_eta, log_keep, initial_state,
                        chunk_size, offset)
    if chunk_resets is not None:
        n = -(-k.shape[2] // chunk_size)
        if offset % chunk_size or tuple(chunk_resets.shape) != (k.shape[0], n) or chunk_resets.dtype != torch.bool:
            raise ValueError(f"titans_linear_chunk_torch: chunk_resets must be bool [B, ceil(T/C)] = "
                             f"{(k.shape[0], n)} with offset a multiple of C, got {chunk_resets.dtype} "
                             f"{tuple(chunk_resets.shape)}, offset {offset}")
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    out_dtype = v.dtype
    q, k, v, theta, log_eta, log_keep = (_acc(t) for t in (q, k, v, theta, log_eta, log_keep))
    M, S, Mh = _initial(initial_state, B, H, dk, dv, k)
    outs = []
    pieces = split_spans(chunk_spans(T, chunk_size, offset), q, k, v, theta, log_eta, log_keep)
    M0, S0 = M, S
    for i, (qc, kn, vc, thc, lec, lkc) in enumerate(pieces):
        if chunk_resets is not None and i > 0:
            r = chunk_resets[:, i, None, None, None]
            M, S = torch.where(r, M0, M), torch.where(r, S0, S)
        # the given anchor only matters when the call starts inside a chunk
        anchor = Mh if (i == 0 and offset % chunk_size) else M
        delta = 2.0 * (kn @ anchor - vc)
        dec = chunk_decays(thc, lec, lkc)
        Y, M, S = chunk_memory_step(M, S, kn, delta, qc, dec)
        outs.append(Y)
        Mh = anchor
    if (offset + T) % chunk_size == 0:
        Mh = M
    o = torch.cat(outs, 2) if outs else v.new_zeros(B, H, 0, dv)
    return o.to(out_dtype), ((M, S, Mh) if output_final_state else None)
