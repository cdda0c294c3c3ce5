"""Model configuration: one structured schema (dataclasses read by omegaconf), the single place a
model's shape lives. Every mixer reads its own section (``ttt``, ``attention``, ``rglru``,
``titans``, ``deltanet``, ``gated_deltanet``, ``mamba``, ``lact``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from ttt_lm.model import registry

#: the built-in layer kinds (ttt_lm.model.registry); a pattern may also name a kind registered
#: since by ``@register_mixer`` (``registry.layer_kinds()``)
LAYER_KINDS = tuple(registry.BUILTIN_KINDS)
#: model.init: which official code the dense layers' initialization follows
#: (ttt_lm.model.layers.init_weights)
INIT_SCHEMES = ("gpt2", "ttt", "griffin", "mamba")
#: model.compile_backend: torch.compile backends (inductor generates kernels; aot_eager and eager
#: only trace, for debugging a compile problem)
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass
class TTTConfig:
    """TTT-Linear / TTT-MLP (Sun et al. 2024)."""
    mini_batch_size: int = 16          # b: tokens per TTT mini-batch
    base_lr: Optional[float] = None    # η_base; None: 1.0 for TTT-Linear, 0.1 for TTT-MLP
    mlp_expansion: int = 4             # TTT-MLP inner hidden = expansion × head_dim
    use_gate: bool = False             # GELU output gate (the "Mamba backbone" variant)
    share_qk: bool = False             # one Q/K projection, separate causal convs for Q and K
    pre_conv: bool = False             # causal conv before the mixer in the block
    conv_width: int = 4
    rope_theta: float = 10000.0
    # Warmup of η_base in training, as ttt-lm-jax's TTT-MLP runs: from base_lr_init to base_lr
    # linearly over base_lr_warmup optimizer steps (None / 0: no warmup)
    base_lr_init: Optional[float] = None
    base_lr_warmup: int = 0


@dataclass
class AttentionConfig:
    num_kv_heads: Optional[int] = None  # grouped/multi-query attention; None = n_heads
    window: int = 1024                  # sliding window of "local_attention" layers (keys t-window+1..t)
    rope_theta: float = 10000.0
    backend: str = "auto"               # auto | sdpa | flex | flash | math


@dataclass
class RGLRUConfig:
    """Griffin's recurrent block (De et al. 2024)."""
    lru_width: Optional[int] = None     # width of the recurrence; None = d_model
    num_heads: Optional[int] = None     # blocks of the block-diagonal gate weights; None = n_heads
    c: float = 8.0
    # Λ init: official (recurrentgemma: a ∈ [a_min, a_max] with a² uniform) | paper (the paper's
    # text: a^c uniform on [a_min, a_max]); see ttt_lm/model/mixers/rglru.py
    a_init: str = "official"
    a_min: float = 0.9
    a_max: float = 0.999
    conv_width: int = 4
    chunk_size: int = 64                # tokens per chunk of the chunked linear scan


@dataclass
class TitansConfig:
    """Titans neural memory (Behrouz et al. 2025)."""
    memory: str = "linear"              # linear | mlp
    memory_expansion: int = 2           # MLP memory hidden = expansion × head_dim
    chunk_size: int = 16                # tokens whose gradients are taken at one memory state
    conv_width: int = 4
    window: int = 256                   # sliding window of the attention in titans_mag and titans_mal
    segment_len: int = 64               # titans_mac: tokens per segment (attention within a segment)
    persistent_tokens: int = 4          # titans_mac, titans_mal: learned persistent memory tokens


@dataclass
class DeltaNetConfig:
    """DeltaNet fast weights (Schlag et al. 2021; Yang et al. 2024)."""
    feature_map: str = "identity"       # identity (L2-normalized) | dpfp
    dpfp_nu: int = 1
    chunk_size: int = 64
    conv_width: int = 4                 # short causal conv on q/k/v (0 = none)


@dataclass
class GatedDeltaNetConfig:
    """Gated DeltaNet (Yang, Kautz & Hatamizadeh 2025); shapes as its official code builds them:
    key width expand_k·d_model, value width expand_v·d_model, split into num_heads heads."""
    num_heads: Optional[int] = None     # None = model.n_heads
    expand_k: float = 0.75              # q/k width = expand_k · d_model (official: 0.75)
    expand_v: float = 1.5               # v / gate / o_proj width = expand_v · d_model (official: 1.5)
    conv_width: int = 4                 # short causal conv on q/k/v (0 = none)
    chunk_size: int = 64


@dataclass
class MambaConfig:
    """Mamba selective SSM (Gu & Dao 2023)."""
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: Optional[int] = None       # None = ceil(d_model / 16)
    dt_min: float = 0.001
    dt_max: float = 0.1
    # tokens per chunk: the PyTorch form's vectorized unit, the Triton kernel's tile (at most 16)
    chunk_size: int = 16


@dataclass
class LaCTConfig:
    """LaCT: large-chunk test-time training with SwiGLU fast weights and sliding-window attention
    in one layer (Zhang et al. 2025); see ttt_lm/model/mixers/lact.py."""
    num_heads: int = 4                  # fast-weight heads (each d_model / num_heads wide)
    chunk_size: int = 2048              # tokens per fast-weight update
    window: int = 2048                  # sliding window of the layer's attention (keys t-window+1..t)
    inter_multi: float = 1.0            # fast-weight hidden width d_h = inter_multi × head width
    low_rank: int = 0                   # > 0: initial w0, w2 = W_left W_right + 0.5·I of this rank; 0: full
    fw_init_gain: float = 0.5           # gain of the low-rank factors' init
    use_momentum: bool = True
    use_muon: bool = False
    muon_dtype: str = "bfloat16"        # dtype of the Newton–Schulz steps: bfloat16 (official) | state
    prenorm: bool = False               # the official prenorm variant of the weight normalisation
    base_lr: float = 0.001              # lr = softplus(W_lr x + softplus⁻¹(base_lr))
    rope_theta: float = 10000.0


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    head_dim: Optional[int] = None      # None = d_model // n_heads
    # Mixer of each layer, repeated cyclically to n_layers (n_layers must be a multiple of its
    # length): ["ttt_linear"] is pure TTT-Linear; ["rglru", "rglru", "local_attention"] is Griffin.
    layer_pattern: List[str] = field(default_factory=lambda: ["ttt_linear"])
    d_ff: Optional[int] = None          # gated MLP width; None = 8/3·d_model rounded up to 64; 0 = no MLP
    mlp_act: str = "silu"               # silu (SwiGLU) | gelu (GeGLU)
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    max_seq_len: int = 2048             # longest context the model is built/evaluated for
    init_std: float = 0.02
    # which official code the dense layers' init follows: gpt2 | ttt | griffin | mamba
    # (ttt_lm.model.layers.init_weights); the paper presets set their architecture's
    init: str = "gpt2"
    kernel_backend: str = "auto"        # auto | torch | triton (see Mixer.kernel_backend)
    # torch.compile every block (LM.compile_blocks); the Triton ops run uncompiled inside them
    compile: bool = False
    compile_backend: str = "inductor"   # torch.compile backend: inductor | aot_eager | eager
    # tokens per chunk of the LM head + cross-entropy in training (ttt_lm.model.loss): the
    # [tokens, vocab] logits are never formed whole; 0 forms them and uses F.cross_entropy
    loss_chunk_size: int = 1024
    # Restart every mixer's state (and attention's context) where a document starts inside a
    # packed training row (position_ids == 0), so no layer carries memory across documents.
    reset_at_doc_boundaries: bool = False
    ttt: TTTConfig = field(default_factory=TTTConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    rglru: RGLRUConfig = field(default_factory=RGLRUConfig)
    titans: TitansConfig = field(default_factory=TitansConfig)
    deltanet: DeltaNetConfig = field(default_factory=DeltaNetConfig)
    gated_deltanet: GatedDeltaNetConfig = field(default_factory=GatedDeltaNetConfig)
    mamba: MambaConfig = field(default_factory=MambaConfig)
    lact: LaCTConfig = field(default_factory=LaCTConfig)

    # ---- derived ---------------------------------------------------------------------------
    @property
    def hd(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def ff(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        return int(64 * -(-(8 * self.d_model // 3) // 64))

    def layer_kinds(self) -> List[str]:
        pat = list(self.layer_pattern)
        return [pat[i % len(pat)] for i in range(self.n_layers)]

    def validate(self) -> "ModelConfig":
        pat = list(self.layer_pattern)
        if not pat:
            raise ValueError("model.layer_pattern is empty")
        known = registry.layer_kinds()
        bad = [k for k in pat if k not in known]
        if bad:
            raise ValueError(f"model.layer_pattern: unknown layer kind(s) {bad}; known: {list(known)}")
        if self.n_layers % len(pat) != 0:
            raise ValueError(f"model.n_layers={self.n_layers} is not a multiple of len(model.layer_pattern)={len(pat)}")
        if self.head_dim is None and self.d_model % self.n_heads != 0:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}")
        if self.mlp_act not in ("silu", "gelu"):
            raise ValueError(f"model.mlp_act must be silu or gelu, got {self.mlp_act!r}")
        if self.attention.backend not in ("auto", "sdpa", "flex", "flash", "math"):
            raise ValueError(f"model.attention.backend must be auto, sdpa, flex, flash or math, "
                             f"got {self.attention.backend!r}")
        if self.kernel_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"model.kernel_backend must be auto, torch or triton, got {self.kernel_backend!r}")
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ValueError(f"model.compile_backend must be one of {list(COMPILE_BACKENDS)}, "
                             f"got {self.compile_backend!r}")
        if not isinstance(self.loss_chunk_size, int) or self.loss_chunk_size < 0:
            raise ValueError(f"model.loss_chunk_size must be >= 0 tokens (0: the full logits and F.cross_entropy), "
                             f"got {self.loss_chunk_size!r}")
        if self.init not in INIT_SCHEMES:
            raise ValueError(f"model.init must be one of {list(INIT_SCHEMES)}, got {self.init!r}")
        t = self.ttt
        if (t.base_lr_init is None) != (t.base_lr_warmup == 0):
            raise ValueError("model.ttt.base_lr_init and model.ttt.base_lr_warmup go together: set both "
                             f"(a warmup from base_lr_init over base_lr_warmup > 0 steps) or neither; got "
                             f"{t.base_lr_init} and {t.base_lr_warmup}")
        if t.base_lr_init is not None and (t.base_lr_init <= 0 or t.base_lr_warmup < 0):
            raise ValueError(f"model.ttt.base_lr_init must be > 0 and base_lr_warmup > 0, got "
                             f"{t.base_lr_init} and {t.base_lr_warmup}")
        kv = self.attention.num_kv_heads
        if kv is not None and self.n_heads % kv != 0:
            raise ValueError(f"model.attention.num_kv_heads={kv} must divide model.n_heads={self.n_heads}")
        return self
