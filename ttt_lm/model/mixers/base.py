"""The interface every sequence mixer implements.

A mixer maps x ∈ R^{B×T×D} to y ∈ R^{B×T×D} causally, and has three forms that tests hold equal:

* ``reference(x, state, output_state)`` — the sequential recurrence (or plain attention), one
  token at a time where the math is a recurrence. It is the specification.
* ``chunked(x, state, output_state)`` — the training form: chunked / dual / parallel, the one
  ``forward`` uses unless ``impl == "reference"``. On CUDA it may call a Triton kernel from
  ``kernels/`` (``kernel_backend``: ``"auto"`` picks Triton on CUDA and PyTorch elsewhere,
  ``"torch"`` / ``"triton"`` force one). Which implementation runs is decided by the one
  resolver, ``ttt_lm.model.backend.resolve(op, requested, device)``, for every mixer (attention's
  SDPA / flex / flash-attn / math by ``attention.backend`` included): ``resolve_backend``.
* ``step(x, state)`` — one-token decode: x is [B, 1, D], state is the cache.

``state`` is the mixer's ``MixerState`` subclass, declared in its own file (recurrent state, conv
caches, KV cache, position; batch first, [B, H, ...] per head). Feeding the state returned by one
segment into the next gives the same outputs as one pass over the concatenation; ``init_state``
returns the state before any token.

Public stages. A mixer whose sequence can be split across ranks (``cp_form`` other than
"state_passing") writes its training form as three public stages, which the context-parallel code
in ``ttt_lm/parallel`` calls without knowing the mixer:

* ``inputs(x, state=None, output_state=False, **kw) -> (op_inputs, carry)``: everything before the
  op. ``op_inputs`` is a dict of the op's keyword arguments (its tensors and settings, not the
  initial state); ``carry`` is the rest of the next state (conv caches, position: the mixer's state type with its
  op's recurrent fields None), or None unless
  ``output_state``.
* ``op(op_inputs, initial_state=None, output_final_state=False, backend="torch") -> (y, final)``:
  the ``kernels/`` op (``backend`` from ``op_backend``, the one resolver).
* ``output(y, x) -> out``: everything after the op.

and declares how the ranks combine (``cp_form``):

* "summary": the op is a linear recurrence, affine in its initial state; ``op_name`` names it
  (an op whose folder has a summary combine, ``kernels/<op>/cp.py``) and the ranks combine chunk
  summaries of it.
* "kv_exchange": attention; ``op_inputs`` holds q, k, v [B, H, T, d] and the ranks gather keys and
  values (``window``: the keys a query sees, None for all).
* "state_passing" (the default): each rank runs the whole mixer from the state the previous rank
  hands it; no stages needed.

For the first two, ``cp_halo`` is how many tokens before a slice ``inputs`` reads (a causal
convolution's width − 1), and ``context_state(x_before, valid, start)`` the state at a slice's
start built from them (the mixer inputs x_before [B, cp_halo, D], ``valid`` False before the
sequence start) and the slice's global start position, without the recurrent part.

With packed documents the parallel forms call ``inputs(x, context_state, docs=slice_docs)``:
``docs`` is then context parallelism's ``SliceDocs`` (the slice of the whole rows' layout:
``starts``, ``offset`` counted from each piece's first token wherever it lies, ``seg``), and the
state's conv cache holds the halo, whose taps the mixer masks by ``docs.offset`` as it masks its
own (``ttt_lm.model.docs.doc_conv`` with the cache); a "summary" mixer passes ``docs.starts`` as
the op's ``resets``, a "kv_exchange" one rotates q and k at ``docs.offset``.

A mixer whose official code reads segment positions (the position of each token in its document,
0 at a document's first token; the data loader's ``position_ids``) sets ``takes_segment_pos``;
its three forms then accept ``segment_pos`` ([B, T] integers) and the block passes it through.

Packed documents. With ``model.reset_at_doc_boundaries`` the block calls ``forward(x, docs=...)``
once for the whole batch, ``docs`` a ``ttt_lm.model.docs.DocLayout`` (document starts, segment
ids, offsets, ``cu_seqlens``, padded and chunk-aligned views), and every document's outputs must
be those of the document alone from ``init_state``. A mixer that sets ``handles_docs`` takes
``docs`` in ``reference`` and ``chunked`` and restarts inside its own computation (masks in the
scan, a document mask); any other mixer gets its form run once on ``docs.pad(x)`` (one document
per row), which is correct for every causal mixer and costs the padding.

Config. A mixer's settings are its own config section, a dataclass declared in its file and
registered with its kind (``@register_mixer(kind, config=Section, section=name)``,
``ttt_lm.model.registry``): ``model.<section>`` of every model config, read as ``cfg.<section>``.
What other code needs to know about a kind is a class attribute read through the registry
(``mixer_class(kind).global_attention``), never a list of kind names kept elsewhere.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from kernels.cp import summary_combine, summary_ops
from ttt_lm.model.backend import Backend, resolve



def _map_value(v, fn):
    if isinstance(v, torch.Tensor):
        return fn(v)
    if isinstance(v, MixerState):
        return v.map(fn)
    if isinstance(v, (tuple, list)):
        return type(v)(_map_value(u, fn) for u in v)
    return v   # None, positions, settings


def _tensors_of(v, out: List[torch.Tensor]) -> None:
    if isinstance(v, torch.Tensor):
        out.append(v)
    elif isinstance(v, MixerState):
        for f in fields(v):
            if not f.metadata.get("derived"):
                _tensors_of(getattr(v, f.name), out)
    elif isinstance(v, (tuple, list)):
        for u in v:
            _tensors_of(u, out)


@dataclass
class MixerState:
    """A mixer's state between segments (recurrent state, conv caches, KV cache) as a typed
    structure: each mixer declares one subclass in its own file, its fields' shapes in the
    docstring. Conventions: every tensor is batch first; a per-head tensor is [B, H, ...]; a
    causal conv cache is [B, channels, width − 1]; a field holding one entry per memory layer is
    a tuple. ``pos`` is how many tokens the state has read (TTT keeps it modulo its mini-batch
    size, as its kernels do); fields marked ``derived`` (metadata) are caches of the others that ``map`` drops.

    ``map(fn)`` applies fn to every tensor (nested states and tuples included) and returns a new
    state of the same type: ``to`` moves device/dtype, ``detach`` cuts the graph and
    ``index_select`` reorders or selects batch rows (beam search's cache reordering)."""
    pos: int = 0

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "MixerState":
        kw = {f.name: (f.default if f.metadata.get("derived") else _map_value(getattr(self, f.name), fn))
              for f in fields(self) if f.init}
        return type(self)(**kw)

    def to(self, device=None, dtype=None) -> "MixerState":
        """Tensors moved to ``device``; floating-point ones cast to ``dtype`` (when given)."""
        return self.map(lambda t: t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point()
                                       else None))

    def detach(self) -> "MixerState":
        return self.map(lambda t: t.detach())

    def index_select(self, index: torch.Tensor) -> "MixerState":
        """The state of batch rows ``index`` (a 1-D integer tensor; rows may repeat or reorder)."""
        if index.dim() != 1:
            raise ValueError(f"MixerState.index_select takes a 1-D index of batch rows, got shape {tuple(index.shape)}")
        return self.map(lambda t: t.index_select(0, index.to(t.device)))

    def named_tensors(self, prefix: str = "") -> List[Tuple[str, torch.Tensor]]:
        """(dotted name, tensor) of every tensor of the state, as ``tensors`` orders them: a nested
        state's fields as ``mem.M.0`` (field, tuple index)."""
        out: List[Tuple[str, torch.Tensor]] = []

        def rec(name: str, v) -> None:
            if isinstance(v, torch.Tensor):
                out.append((name, v))
            elif isinstance(v, MixerState):
                for f in fields(v):
                    if not f.metadata.get("derived"):
                        rec(f"{name}.{f.name}" if name else f.name, getattr(v, f.name))
            elif isinstance(v, (tuple, list)):
                for i, u in enumerate(v):
                    rec(f"{name}.{i}", u)
        rec(prefix, self)
        return out

    def tensors(self) -> List[torch.Tensor]:
        """Every tensor of the state (nested ones included, derived fields left out), in field order."""
        out: List[torch.Tensor] = []
        _tensors_of(self, out)
        return out


#: a mixer's state (kept as a name for type hints)
State = MixerState

#: how a mixer runs over a sequence split across context-parallel ranks (``Mixer.cp_form``)
CP_FORMS = ("state_passing", "summary", "kv_exchange")
#: the public stages a mixer with a parallel context-parallel form defines
STAGES = ("inputs", "op", "output", "context_state")


@dataclass(frozen=True)
class TPPlan:
    """How Megatron tensor parallelism splits a mixer across p ranks by heads (``Mixer.tp_plan``):
    each entry names attributes of the mixer. ``ttt_lm.parallel.tp_model`` applies it.

    * ``column``: nn.Linear layers split by output features (rank r keeps heads r·H/p …); their
      input is the replicated block input.
    * ``row``: nn.Linear layers split by input features, reading the column-split activations;
      their partial outputs are summed across ranks.
    * ``channel_convs``: depthwise nn.Conv1d split by channels (= by heads).
    * ``head_params``: parameters sliced along dimension 0 (one entry per head).
    * ``group_norms``: nn.LayerNorm layers over the features of all heads: their gain and bias
      are sliced and their mean and variance come from every rank.
    * ``shared``: nn.Identity hooks the mixer passes a value through that every head uses (a
      replicated parameter): tensor parallelism swaps them for f (identity forward, the gradient
      summed across ranks, since each rank's gradient covers its heads only).
    * ``head_counts``: integer attributes divided by p (number of heads, widths).
    * ``row_to_heads``: nn.Linear layers split by input features (reading column-split
      activations) whose summed output every rank's heads read (Mamba's x_proj: dt, B, C for all
      channels): all-reduced in forward and backward, kept inside the TP region.
    * ``shared_modules``: modules (e.g. an RMSNorm over one head's features) whose parameters
      every head uses: replicated, their gradients summed across ranks.
    * ``fused``: (name, n) pairs for entries of ``column``, ``channel_convs`` or ``head_params``
      whose split dimension concatenates n equal parts (a fused [q | k | v] conv, Mamba's
      [x | z] in_proj), each split by heads (Megatron's partition_stride); n may also be a tuple of
      the parts' sizes, for parts of unequal sizes (Mamba-2's [z | x | B | C | dt] in_proj).

    * ``sequence_region``: replicated modules that run after the mixer's row-parallel outputs
      are summed (a combination of two branches, as Titans MAG's gate and W_O): every rank holds
      the same activations, or with sequence parallelism its T/p tokens, when their gradients
      are summed across ranks; the mixer's output is then already in the block's region.

    * ``row_full_sequence``: nn.Linear layers split by input features whose summed output the
      mixer reads over the whole sequence (g: all-reduce forward, identity backward), with sequence
      parallelism too; every consumer must then give it the full gradient (per-head consumers
      through a ``shared`` hook, the mixer's output through a ``sequence_split`` hook).
    * ``sequence_split``: nn.Identity hooks on the mixer's output when that output is computed over
      the whole sequence on every rank: with sequence parallelism they keep this rank's T/p tokens
      (the gradient is all-gathered back); without, they do nothing.

    * ``sequence_parallel``: False where the mixer cannot take the sequence-split region's
      reductions at its output: tensor parallelism then refuses sequence parallelism for a model
      with this layer (no built-in mixer needs it: Titans MAL, which drops its persistent positions
      after the attention's W_O, uses ``row_full_sequence`` and ``sequence_split`` instead).

    A name may be a dotted path to a submodule's attribute (``conv1d.conv``, ``gate_a.weight``);
    ``prefixed`` and ``merged`` build the plan of a mixer made of sub-mixers from theirs."""
    column: Tuple[str, ...] = ()
    row: Tuple[str, ...] = ()
    channel_convs: Tuple[str, ...] = ()
    head_params: Tuple[str, ...] = ()
    group_norms: Tuple[str, ...] = ()
    shared: Tuple[str, ...] = ()
    head_counts: Tuple[str, ...] = ()
    row_to_heads: Tuple[str, ...] = ()
    shared_modules: Tuple[str, ...] = ()
    fused: Tuple[Tuple[str, int], ...] = ()
    sequence_region: Tuple[str, ...] = ()
    row_full_sequence: Tuple[str, ...] = ()
    sequence_split: Tuple[str, ...] = ()
    sequence_parallel: bool = True

    def prefixed(self, prefix: str) -> "TPPlan":
        """This plan for a sub-mixer held under attribute ``prefix``."""
        kw = {f.name: tuple(f"{prefix}.{n}" for n in getattr(self, f.name)) for f in fields(self)
              if f.name not in ("fused", "sequence_parallel")}
        return TPPlan(fused=tuple((f"{prefix}.{n}", k) for n, k in self.fused),
                      sequence_parallel=self.sequence_parallel, **kw)

    def merged(self, *others: "TPPlan") -> "TPPlan":
        """One plan holding the entries of this plan and ``others``."""
        kw = {f.name: sum((getattr(q, f.name) for q in others), getattr(self, f.name)) for f in fields(self)
              if f.name != "sequence_parallel"}
        return TPPlan(sequence_parallel=all(q.sequence_parallel for q in (self, *others)), **kw)


class Mixer(nn.Module, metaclass=abc.ABCMeta):
    """Subclasses set ``self.d_model`` and implement chunked, reference, step and init_state."""

    #: set by the model: "chunked" (default) or "reference"
    impl: str = "chunked"
    #: "auto" | "torch" | "triton": which implementation of a kernels/ op the chunked form uses
    kernel_backend: str = "auto"
    #: init_weights() calls reset_parameters() on mixers after the generic init
    _mixer_init: bool = True
    #: the forms take ``segment_pos`` [B, T] (position of each token in its document)
    takes_segment_pos: bool = False
    #: set by ``@register_mixer``: the kind a layer pattern names this mixer by
    layer_kind: Optional[str] = None
    #: set by ``@register_mixer``: the model config section this mixer reads (``model.<section>``)
    #: and its schema dataclass; None for a mixer without a section of its own
    config_section: Optional[str] = None
    config_class: Optional[type] = None
    #: attention over every earlier token (no window): its cost and positional range (RoPE, the
    #: memory plan) grow with the context, so evals refuse contexts beyond ``model.max_seq_len``
    global_attention: bool = False
    #: attends over earlier tokens (attention, a sliding window, an attention branch); False: a
    #: pure recurrence, whose cost per token is flat in the sequence length
    attends: bool = False
    #: named variants of the section's settings that the shared tests run as cases of their own
    #: and benchmarks time as rows of their own (``benchmarks/chunk_scaling.py``: ``<kind>_<name>``);
    #: empty: the kind as configured
    variants: Dict[str, Dict[str, object]] = {}
    #: the init scheme (``model.init``) of this kind's official code, which the presets of the
    #: kind alone take; None: no scheme of its own (the presets keep ``gpt2``)
    official_init: Optional[str] = None
    #: the scheme of the official code of its hybrids with attention layers (Gated DeltaNet's
    #: hybrid code inits every layer as mamba_ssm does); None: the hybrids keep ``gpt2``
    official_hybrid_init: Optional[str] = None
    #: context-parallel form, one of CP_FORMS (see the module docstring)
    cp_form: str = "state_passing"
    #: "summary" form: the kernels/ op whose summaries combine across ranks (``kernels/<op>/cp.py``)
    op_name: Optional[str] = None
    #: "kv_exchange" form: keys a query sees (None: every earlier key)
    window: Optional[int] = None
    #: the ``kernels::`` custom op (``torch.library``) through which the chunked form's Triton
    #: backend runs, by its forward's name (its backward is ``<name>_bwd``): a compiled block holds
    #: it as one opaque node. None: the mixer calls no Triton op of its own
    triton_custom_op: Optional[str] = None
    #: the graph breaks a compiled block of this mixer may have (never at its op): a phrase of
    #: dynamo's reason for each, e.g. "aten.nonzero" for a host read; None: the block breaks nowhere
    compile_graph_breaks: Optional[str] = None

    @property
    def cp_halo(self) -> int:
        """Tokens before a slice that ``inputs`` reads (a causal conv's width − 1); 0 for none."""
        return 0

    #: the forms take ``docs`` (a ``ttt_lm.model.docs.DocLayout``) and restart at its document
    #: starts inside the packed rows themselves (masks in the scan / attention); False: ``forward``
    #: runs the form once on the layout's padded view (one document per row)
    handles_docs: bool = False
    #: the Triton entry (``"module:function"``) that the chunked form with ``docs`` on the Triton
    #: backend calls once per forward, on the batch flattened to one row with the layout's
    #: ``cu_seqlens`` (``ttt_lm.model.docs.check_packed_triton``'s refusals apply); None: no such path
    varlen_triton_op: Optional[str] = None

    def forward(self, x: torch.Tensor, state: Optional[State] = None,
                output_state: bool = False, docs=None, **kw) -> Tuple[torch.Tensor, Optional[State]]:
        """``kw``: ``segment_pos`` for mixers that set ``takes_segment_pos``. ``docs``: the batch's
        ``DocLayout`` when every document of a packed row must start from the initial state (the
        LM's ``model.reset_at_doc_boundaries``): one call of the form for the whole batch, either
        with ``docs`` (``handles_docs``) or on ``docs.pad(x)``; the result is each document's own
        output, as if it ran alone. ``docs`` takes no carried state."""
        if self.impl not in ("chunked", "reference"):
            raise ValueError(f"mixer impl must be 'chunked' or 'reference', got {self.impl!r}")
        form = self.reference if self.impl == "reference" else self.chunked
        if docs is None or not docs.inner_starts:
            return form(x, state, output_state, **kw)
        if state is not None or output_state:
            raise ValueError("document resets (docs) cannot be combined with a carried or returned state")
        if self.handles_docs:
            return form(x, None, False, docs=docs, **kw)
        return self.run_padded(form, x, docs, **kw)

    @staticmethod
    def run_padded(form, x: torch.Tensor, docs, **kw) -> Tuple[torch.Tensor, None]:
        """``form`` once on the padded view of packed rows (``docs.pad``: one document per row from
        the initial state), its output put back in the packed layout."""
        y, _ = form(docs.pad(x), None, False, **{k: docs.pad(v) for k, v in kw.items()})
        return docs.unpad(y), None

    @abc.abstractmethod
    def chunked(self, x, state=None, output_state=False):
        """Training form: (y [B, T, D], the state after the last token if output_state else None)."""

    @abc.abstractmethod
    def reference(self, x, state=None, output_state=False):
        """Sequential form, same contract as chunked: the specification the other forms match."""

    @abc.abstractmethod
    def step(self, x: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """One token: x [B, 1, D] and the cache → (y [B, 1, D], the updated cache)."""

    @abc.abstractmethod
    def init_state(self, batch_size: int, device=None, dtype=None) -> State:
        """The state before the first token."""

    def reset_parameters(self) -> None:
        """Mixer-specific initialization, run after the model's generic init."""

    def set_train_step(self, step: int) -> None:
        """The optimizer step (1-based) that comes next, for a mixer with a training schedule
        of its own (TTT's inner learning-rate warmup); the model calls it on every mixer."""

    @classmethod
    def tp_plan(cls, cfg) -> Optional[TPPlan]:
        """How tensor parallelism splits this mixer as ``cfg`` (the ModelConfig) builds it; None:
        not TP-ready (tensor parallelism refuses a model with such a layer)."""
        return None

    @classmethod
    def block_pre_conv(cls, cfg) -> Optional[int]:
        """Width of the causal convolution that the block runs over the residual stream before
        this mixer (TTT's ``ttt.pre_conv``), or None for none. ``cfg`` is the ModelConfig."""
        return None

    @staticmethod
    def flops_per_token(cfg, seq_len: int) -> float:
        """Forward FLOPs per token of this mixer beyond its dense projections (those are counted
        from parameter shapes in ttt_lm.model.flops): attention scores, inner-model updates,
        scans. ``cfg`` is the ModelConfig."""
        return 0.0

    #: the op ``resolve_backend`` resolves a backend for (``ttt_lm.model.backend``): a ``kernels/``
    #: op's name, or "attention" / "local_attention"; None: ``op_name``, else the layer kind
    backend_op: Optional[str] = None
    #: whether the op is a ``kernels/`` op that ``kernel_backend`` selects (attention's backend
    #: is ``attention.backend`` instead)
    uses_kernel_op: bool = True

    #: the contract of the ``kernels/`` op the chunked form calls (``kernels.contract.OpContract``,
    #: the op folder's ``CONTRACT``): what its Triton backend covers; None: no such op
    op_contract: Optional[Any] = None
    #: the config key each ``contract_args`` entry comes from, as a refusal names it
    contract_labels: Dict[str, str] = {}

    def contract_args(self) -> Dict[str, Any]:
        """The arguments of this layer's op call that its contract reads (head sizes and options,
        by the op's names for them)."""
        return {}

    def triton_unavailable(self, dtype=None) -> Optional[str]:
        """Why no Triton kernel covers this layer as configured (None when one does): its op's
        contract's answer for ``contract_args`` (and ``dtype`` where known)."""
        if self.op_contract is None:
            return "no Triton kernel for this layer kind"
        return self.op_contract.triton_unavailable(dtype, labels=self.contract_labels, **self.contract_args())

    def backend_limits(self, dtype=None) -> Dict[Backend, Optional[str]]:
        """Backend → why this layer as configured has no implementation on it (None: it has);
        passed to ``resolve`` as the op's own limits."""
        return {Backend.TRITON: self.triton_unavailable(dtype)}

    def requested_backend(self) -> str:
        """The config string naming the backend: ``kernel_backend`` for a ``kernels/`` op."""
        kb = self.kernel_backend
        if kb not in ("auto", "torch", "triton"):
            raise ValueError(f"model.kernel_backend must be auto, torch or triton, got {kb!r}")
        return kb

    def resolve_backend(self, device, dtype=None) -> Backend:
        """What the chunked form runs on ``device``: the one resolver's answer (``resolve``) for
        ``backend_op`` and ``requested_backend``. For a ``kernels/`` op "auto" picks Triton on
        CUDA where a kernel covers the layer, PyTorch otherwise; ``kernel_backend="triton"``
        where no kernel applies is an error naming the reason, never a silent fallback."""
        requested = self.requested_backend()
        if self.uses_kernel_op and requested == "torch":
            return Backend.TORCH
        op = self.backend_op or self.op_name or self.layer_kind or type(self).__name__
        try:
            return resolve(op, requested, device, dtype, self.backend_limits(dtype))
        except ValueError as e:
            if self.uses_kernel_op and requested == "triton":
                raise ValueError(f"model.kernel_backend=triton: {type(self).__name__} has no Triton kernel: {e}; "
                                 f"use kernel_backend=auto (PyTorch where no kernel applies) or torch") from None
            raise

    def _resolve_backend(self, x: torch.Tensor) -> Backend:
        return self.resolve_backend(x.device, x.dtype)

    def op_backend(self, x: torch.Tensor) -> Backend:
        """The ``backend`` argument of ``op`` for input x: ``Backend.REFERENCE`` under
        ``impl="reference"``, else ``resolve_backend``'s answer for x's device and dtype."""
        return Backend.REFERENCE if self.impl == "reference" else self.resolve_backend(x.device, x.dtype)


def check_contract(cls: type) -> None:
    """Refuse a mixer class whose declarations do not fit together (run by ``@register_mixer``)."""
    name = cls.__qualname__
    if cls.cp_form not in CP_FORMS:
        raise ValueError(f"{name}.cp_form must be one of {CP_FORMS}, got {cls.cp_form!r}")
    if cls.cp_form == "state_passing":
        return
    missing = [m for m in STAGES if not callable(getattr(cls, m, None))]
    if missing:
        raise TypeError(f"{name} declares cp_form={cls.cp_form!r} but does not define the public stage(s) {missing}")
    if cls.cp_form == "summary" and (not isinstance(cls.op_name, str) or summary_combine(cls.op_name) is None):
        raise ValueError(f"{name} declares cp_form='summary': op_name must be one of {summary_ops()} (the "
                         f"kernels/ ops with a summary combine, kernels/<op>/cp.py), got {cls.op_name!r}")
