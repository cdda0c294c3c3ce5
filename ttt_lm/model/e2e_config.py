"""``model.ttt_e2e``: the switch and settings of TTT-E2E (``ttt_lm.model.e2e``), kept apart from the
model so that the config schema imports no torch.

TTT-E2E is a model variant, not a layer kind: its inner loss runs through the final norm and the LM
head, so it is a section of the model config that ``LM(cfg)`` reads (``enabled``), not a mixer of
``model.layer_pattern`` (which the E2E model does not read).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ttt_lm.model.registry import option

#: model.ttt_e2e.suffix_attention: the TTT blocks' attention differentiates twice (the inner
#: gradient is differentiated again by the outer one), which only these paths support
SUFFIX_ATTENTION = ("math", "sdpa_math")
#: paths without a double backward: refused for the TTT blocks, with the reason
NO_DOUBLE_BACKWARD = ("flash", "flex", "sdpa", "auto")
#: model.ttt_e2e.prefix_attention: the prefix blocks need a first-order backward only
PREFIX_ATTENTION = ("sdpa", "math")


@dataclass
class TTTE2EConfig:
    """End-to-end test-time training (Tandon et al. 2025, arXiv 2512.23675; its JAX code,
    github test-time-training/e2e). ``enabled`` builds :class:`ttt_lm.model.e2e.E2ELM` for ``LM(cfg)``.

    suffix_len S: the last S of ``model.n_layers`` blocks are TTT blocks (0: the same architecture
    without them, the paper's baselines); inner_batch b: tokens per inner step; window w: every
    attention layer's sliding window (keys t−w+1 … t; None: full attention, without TTT blocks); inner_lr η, inner_clip c: W ← W − η·ρ·clip_c(g);
    ρ warms up from ilr_init/η to 1 over ilr_warmup_steps optimizer steps (0: ρ = 1)."""
    enabled: bool = False
    suffix_len: int = option(0, ge=0)
    inner_batch: int = option(1024, ge=1)
    window: Optional[int] = option(8192, ge=1)     # None: full attention (no TTT blocks only)
    rope_theta: float = option(500000.0, gt=0)
    inner_lr: float = option(1.0, gt=0)
    inner_clip: float = option(1.0, gt=0)
    ilr_init: float = option(0.1, gt=0)
    ilr_warmup_steps: int = option(0, ge=0)
    # attention of the TTT blocks (second order): math (explicit softmax) | sdpa_math (SDPA's math kernel)
    suffix_attention: str = "math"
    # attention of the prefix blocks (first order): sdpa | math
    prefix_attention: str = option("sdpa", choices=PREFIX_ATTENTION)
    # rematerialise in the backward: the prefix (saves nothing) and each chunk's inner step
    remat: bool = True

    def validate(self, model) -> None:
        if self.suffix_attention in NO_DOUBLE_BACKWARD:
            raise ValueError(f"model.ttt_e2e.suffix_attention={self.suffix_attention!r}: the TTT blocks' attention is "
                             "differentiated twice (the outer gradient goes through the inner gradient) and that "
                             "backend has no double backward (flash and flex kernels, and SDPA's choice of one, "
                             f"differentiate once); use one of {list(SUFFIX_ATTENTION)}")
        if self.suffix_attention not in SUFFIX_ATTENTION:
            raise ValueError(f"model.ttt_e2e.suffix_attention must be one of {list(SUFFIX_ATTENTION)}, "
                             f"got {self.suffix_attention!r}")
        if not self.enabled:
            return
        if self.suffix_len > model.n_layers:
            raise ValueError(f"model.ttt_e2e.suffix_len={self.suffix_len} exceeds model.n_layers={model.n_layers} "
                             "(the TTT blocks are the last suffix_len blocks)")
        if self.window is None and self.suffix_len > 0:
            raise ValueError(f"model.ttt_e2e.window=None (full attention) needs suffix_len=0; the TTT blocks read "
                             f"a window cache, and suffix_len={self.suffix_len}")
        if self.ilr_init > self.inner_lr:
            raise ValueError(f"model.ttt_e2e.ilr_init={self.ilr_init} exceeds model.ttt_e2e.inner_lr={self.inner_lr} "
                             "(the warm-up rises from ilr_init to inner_lr)")
        if model.hd % 2:
            raise ValueError(f"model.ttt_e2e: the interleaved RoPE rotates pairs of channels; head_dim={model.hd} is odd")
        if model.head_dim is not None and model.head_dim * model.n_heads != model.d_model:
            raise ValueError(f"model.ttt_e2e: head_dim·n_heads must be d_model (q, k, v are [d_model, d_model]), got "
                             f"{model.head_dim}·{model.n_heads} != {model.d_model}")
        if model.ff <= 0:
            raise ValueError(f"model.ttt_e2e: every block has a SwiGLU MLP; model.d_ff={model.d_ff} leaves it out")
        if model.mlp_act != "silu":
            raise ValueError(f"model.ttt_e2e: the MLPs are SwiGLU; model.mlp_act={model.mlp_act!r} is not silu")
        if model.reset_at_doc_boundaries:
            raise ValueError("model.ttt_e2e: model.reset_at_doc_boundaries=true is not supported (the official "
                             "code reads packed rows whole, with the BOS targets masked)")
        if model.compile:
            raise ValueError("model.ttt_e2e: model.compile=true is not supported (the inner step calls "
                             "torch.autograd.grad inside the forward)")

    def validate_training(self, cfg) -> None:
        """What a training run must also satisfy (``ttt_lm.train.config.check_training_config``)."""
        if not self.enabled:
            return
        T, b = cfg.data.seq_len, self.inner_batch
        if self.suffix_len > 0 and T % b:
            raise ValueError(f"model.ttt_e2e.inner_batch={b} must divide data.seq_len={T} in training (every "
                             "training chunk is a full inner batch, as in the official code; the partial-chunk "
                             "rule serves evaluation)")
        tp, cp = cfg.parallel.tensor_parallel, cfg.parallel.context_parallel
        if tp > 1 and cfg.parallel.sequence_parallel:
            raise ValueError(f"model.ttt_e2e: parallel.sequence_parallel=true is not built for TTT-E2E (set it to false; "
                             f"parallel.tensor_parallel={tp} alone is supported). Its tensor-parallel form splits the "
                             "heads and the MLP features, the prime MLPs' fast weights included; the inner step runs "
                             "the chunk's tokens through the replicated final norm and LM head on every rank")
        if cp > 1:
            raise ValueError(f"model.ttt_e2e: parallel.context_parallel={cp} is refused for TTT-E2E (set it to 1). "
                             "The inner loop is sequential over chunks: chunk i runs with the fast weights W^(i), "
                             "which every earlier chunk's gradient step produced, so passing the fast weights and "
                             "the window caches from rank to rank serialises the ranks (rank r+1 waits for rank r's "
                             "last chunk, and the second-order backward runs back through them in reverse); only "
                             "the first-order prefix blocks would run in parallel")
