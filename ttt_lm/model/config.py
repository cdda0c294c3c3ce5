"""Model configuration: one structured schema (dataclasses read by omegaconf), the single place a
model's shape lives.

``ModelConfig`` holds what every model has (widths, depth, the layer pattern, norms, the head) and
one section per registered mixer config: ``model.<section>`` is the dataclass a mixer declares in
its own file with ``@register_mixer(kind, config=..., section=...)`` (``ttt_lm.model.registry``).
This module names no layer kind. ``ModelConfig(...)`` makes an instance of the class built from
the sections registered now (``model_config_class``; it imports the built-in mixers on first
use), so ``cfg.ttt.mini_batch_size`` and ``ModelConfig(d_model=64).rglru`` work as for fixed
fields, omegaconf reads it as a structured schema, and ``validate`` runs each section's checks.
A run whose mixers live outside the package names their modules in ``model.mixer_modules``;
:func:`model_schema` imports them before the schema is built.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ttt_lm.model import registry
from ttt_lm.model.e2e_config import TTTE2EConfig

#: model.init: which official code the dense layers' initialization follows
#: (ttt_lm.model.layers.init_weights)
INIT_SCHEMES = ("gpt2", "ttt", "griffin", "mamba")
#: model.compile_backend: torch.compile backends (inductor generates kernels; aot_eager and eager
#: only trace, for debugging a compile problem)
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    head_dim: Optional[int] = None      # None = d_model // n_heads
    # Mixer of each layer, repeated cyclically to n_layers (n_layers must be a multiple of its
    # length): [ttt_linear] is pure TTT-Linear; [rglru, rglru, local_attention] is Griffin.
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
    # modules (dotted names importable from sys.path, or .py paths) that register mixers defined
    # outside the package; imported before the config is read, so their kinds and sections exist
    mixer_modules: List[str] = field(default_factory=list)
    # TTT-E2E (a model variant, not a layer kind): model.ttt_e2e.enabled builds ttt_lm.model.e2e.E2ELM
    ttt_e2e: TTTE2EConfig = field(default_factory=TTTE2EConfig)
    # one field per registered config section follows (model_config_class)

    def __new__(cls, *args, **kwargs):
        # ModelConfig(...) builds the class that has every registered section
        return object.__new__(model_config_class() if cls is ModelConfig else cls)

    def __reduce__(self):
        # pickled by value: the class is rebuilt (with its sections) where it is unpickled
        return (_rebuild, ({f.name: getattr(self, f.name) for f in dataclasses.fields(self)},))

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

    def sections(self) -> Dict[str, Any]:
        """Section name → this config's section (every registered mixer section it has)."""
        return {name: getattr(self, name) for name in registry.sections() if hasattr(self, name)}

    def validate(self) -> "ModelConfig":
        pat = list(self.layer_pattern)
        if not pat:
            raise ValueError("model.layer_pattern is empty")
        registry.import_mixer_modules(self.mixer_modules)
        known = registry.layer_kinds()
        bad = [k for k in pat if k not in known]
        if bad:
            hints = "".join(registry.did_you_mean(k, known) for k in bad)
            raise ValueError(f"model.layer_pattern: unknown layer kind(s) {bad}{hints}; known: {list(known)}")
        if self.n_layers % len(pat) != 0:
            raise ValueError(f"model.n_layers={self.n_layers} is not a multiple of len(model.layer_pattern)={len(pat)}")
        if self.head_dim is None and self.d_model % self.n_heads != 0:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}")
        if self.mlp_act not in ("silu", "gelu"):
            raise ValueError(f"model.mlp_act must be silu or gelu, got {self.mlp_act!r}")
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
        used = {mixer_class_section(k) for k in pat}
        missing = sorted(n for n in used if n is not None and not hasattr(self, n))
        if missing:
            raise ValueError(f"model: no section(s) {missing} for the layer pattern's mixers (registered after this "
                             "config was made); build the config after importing the mixers' modules")
        # every section is checked, whether or not the pattern uses its kinds
        for name, section in self.sections().items():
            registry.check_section(name, section, self)
        registry.check_section("ttt_e2e", self.ttt_e2e, self)
        return self


def model_config_dict(cfg: "ModelConfig") -> dict:
    """``cfg`` as a plain dict, as saved beside a model (a Hugging Face ``config.json``). The
    sections of plugin mixers that were registered in this process but that this model neither
    uses (no layer of its pattern) nor imports (``model.mixer_modules``) are left out, so that
    the dict loads in a process that never imported those plugins."""
    import os

    from omegaconf import OmegaConf
    d = OmegaConf.to_container(OmegaConf.structured(cfg))
    used = {mixer_class_section(k) for k in cfg.layer_pattern}
    # a mixer_modules entry is a module name or a .py path, imported as the module of its file's name
    imported = {os.path.splitext(os.path.basename(m))[0] if m.endswith(".py") else m for m in cfg.mixer_modules or ()}
    for name, module in registry.plugin_sections().items():
        if name not in used and module not in imported:
            d.pop(name, None)
    return d


def mixer_class_section(kind: str) -> Optional[str]:
    """The config section the mixer of ``kind`` reads (None: none of its own)."""
    return registry.mixer_class(kind).config_section


#: sections → the ModelConfig class with them (one class per set of registered sections)
_CLASSES: Dict[tuple, type] = {}


def model_config_class() -> type:
    """The ModelConfig dataclass with one field per registered section (``registry.sections()``):
    ``model.<section>``, defaulting to the section's dataclass. A subclass of ``ModelConfig``,
    named like it; rebuilt when a mixer registers a new section."""
    secs = registry.sections()
    key = tuple(secs.items())
    cls = _CLASSES.get(key)
    if cls is None:
        own = {f.name for f in dataclasses.fields(ModelConfig)} | set(vars(ModelConfig))
        clash = sorted(n for n in secs if n in own)
        if clash:
            owners = {n: getattr(secs[n], "__module__", "?") for n in clash}
            raise ValueError(f"config section(s) {clash} of {owners} clash with ModelConfig's own fields or methods; "
                             "register them under another section name")
        cls = dataclasses.make_dataclass("ModelConfig", [(n, c, field(default_factory=c)) for n, c in secs.items()],
                                         bases=(ModelConfig,), namespace={"__module__": __name__})
        cls.__qualname__ = "ModelConfig"
        cls.__doc__ = ModelConfig.__doc__
        _CLASSES[key] = cls
    return cls


def _rebuild(values: dict) -> "ModelConfig":
    registry.import_mixer_modules(values.get("mixer_modules") or ())
    return ModelConfig(**values)


def model_schema(model: Optional[dict] = None):
    """The omegaconf schema of a model config (a structured DictConfig of ``ModelConfig()``), after
    importing the modules that ``model`` (a model config as a dict, e.g. a saved one) names in
    ``mixer_modules``."""
    from omegaconf import OmegaConf
    if model:
        registry.import_mixer_modules(list(model.get("mixer_modules") or ()))
    return OmegaConf.structured(ModelConfig())


def model_config_from_dict(d: Optional[dict]) -> "ModelConfig":
    """A ModelConfig from its dict (a saved config's ``model``; None: the defaults), its keys and
    types checked against the schema; not validated."""
    from omegaconf import OmegaConf
    return OmegaConf.to_object(OmegaConf.merge(model_schema(d), d or {}))


def __getattr__(name: str):
    # kept for callers of names this module had: LAYER_KINDS (the built-in kinds) and the section
    # dataclasses (TTTConfig, ...), now in their mixers' files, found through the registry
    if name == "LAYER_KINDS":
        return registry.builtin_kinds()
    for section in registry.sections().values():
        if section.__name__ == name:
            return section
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
