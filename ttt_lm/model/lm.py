"""The language model: token embedding → blocks → RMSNorm → LM head.

A block is pre-norm residual (as in Llama and Griffin):

    h = x + Mixer(RMSNorm(x))          # the mixer of this layer, from model.layer_pattern
    y = h + GatedMLP(RMSNorm(h))        # left out when model.d_ff = 0 (Mamba's blocks)

TTT layers with ``ttt.pre_conv`` add, before the mixer, the residual causal convolution of the TTT
paper's "Mamba backbone": x ← x + Conv(RMSNorm(x)).

``forward(input_ids, labels)`` takes labels aligned with the inputs (labels[t] is the token that
should follow input_ids[t]; −100 is ignored), so the data pipeline does the shift once. With labels
the head and the loss are one chunked step (``ttt_lm.model.loss.linear_cross_entropy``,
``model.loss_chunk_size`` tokens at a time): the [B, T, V] logits are never formed, and the output's
``logits`` is None. ``model.loss_chunk_size=0`` forms them and takes F.cross_entropy of their
float32 copy instead (the same loss; memory grows with B·T·V).

Packed rows: with ``model.reset_at_doc_boundaries`` and the data's ``position_ids`` (0 at each
document's first token), every token-mixing part of a block (the mixer and the pre-conv) reads each
document of a row from a fresh state, exactly as if each document were its own sequence, in one
call per layer for the whole batch: ``forward`` checks the positions and builds the batch's
``DocLayout`` once (``ttt_lm.model.docs``), on the host, and moves it to the model's device, and
every block passes it to its mixer (``Mixer.forward``'s ``docs``) and masks its pre-conv
(``doc_conv``). With the loader's positions (CPU tensors) nothing is read back from the device
for the layout or any of its views; positions given on a device are read back once per batch.
Positions are checked whenever they are given: a first position below 0 or a jump inside a
document is a ValueError naming the row and position.

Segment positions: mixers whose official code reads them (``Mixer.takes_segment_pos``: Griffin's
RG-LRU block) get ``position_ids`` as ``segment_pos`` whenever they are given, in training and in
``step``, whatever ``model.reset_at_doc_boundaries`` says: the RG-LRU resets where
segment_pos = 0 and normalizes every other token, as recurrentgemma does.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch import nn

from ttt_lm.model.config import ModelConfig
from ttt_lm.model.docs import DocLayout, host_to_device, doc_conv
from ttt_lm.model.layers import CausalConv1d, GatedMLP, RMSNorm, init_weights
from ttt_lm.model.loss import linear_cross_entropy, plain_cross_entropy
from ttt_lm.model.mixers import build_mixer, mixer_class
from ttt_lm.model.mixers.base import MixerState

#: prompt tokens per forward pass when ``LM.generate`` reads a prompt (``LM.prefill``)
PREFILL_CHUNK = 2048

@dataclass
class BlockState(MixerState):
    """A block's decode state: mixer, its mixer's state (the mixer's ``MixerState`` subclass);
    pre_conv [B, D, w − 1], the pre-conv's cache (None for a block without one); pos: the
    mixer's."""
    mixer: Optional[MixerState] = None
    pre_conv: Optional[torch.Tensor] = None


@dataclass
class LMOutput:
    logits: Optional[torch.Tensor]
    loss: Optional[torch.Tensor] = None
    states: Optional[List[BlockState]] = None


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.kind = cfg.layer_kinds()[layer_idx]
        self.pre_conv = None
        pre_conv = mixer_class(self.kind).block_pre_conv(cfg)
        if pre_conv is not None:
            self.pre_conv_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.pre_conv = CausalConv1d(cfg.d_model, pre_conv)
        self.mixer_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = build_mixer(self.kind, cfg, layer_idx)
        # d_ff = 0 leaves the MLP out (Mamba's blocks are mixer-only)
        self.mlp = GatedMLP(cfg.d_model, cfg.ff, cfg.mlp_act) if cfg.ff > 0 else None
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if self.mlp is not None else None

    def init_state(self, batch_size: int, device=None, dtype=None) -> BlockState:
        ms = self.mixer.init_state(batch_size, device, dtype)
        return BlockState(mixer=ms, pos=ms.pos, pre_conv=None if self.pre_conv is None else
                          self.pre_conv.init_cache(batch_size, device, dtype))

    def mixer_kw(self, position_ids: Optional[torch.Tensor]) -> dict:
        """What the mixer takes beyond (x, state): segment_pos for mixers that read it."""
        return {"segment_pos": position_ids} if position_ids is not None and self.mixer.takes_segment_pos else {}

    def forward(self, x: torch.Tensor, state: Optional[BlockState] = None, output_state: bool = False,
                docs: Optional[DocLayout] = None, position_ids: Optional[torch.Tensor] = None):
        """``docs``: the batch's document layout when documents restart inside packed rows (the
        pre-conv and the mixer then run once on the whole batch, each document from a fresh
        state; ``Mixer.forward``)."""
        cc = None
        if self.pre_conv is not None:
            xn = self.pre_conv_norm(x)
            if docs is not None and docs.inner_starts:
                c = doc_conv(self.pre_conv, xn, docs)
            else:
                c, cc = self.pre_conv(xn, None if state is None else state.pre_conv, output_state)
            x = x + c
        h, ms = self.mixer(self.mixer_norm(x), None if state is None else state.mixer, output_state,
                           docs=docs, **self.mixer_kw(position_ids))
        x = x + h
        if self.mlp is not None:
            x = x + self.mlp(self.mlp_norm(x))
        return x, (BlockState(mixer=ms, pos=ms.pos, pre_conv=cc) if output_state else None)

    def step(self, x: torch.Tensor, state: BlockState, position_ids: Optional[torch.Tensor] = None):
        cc = None
        if self.pre_conv is not None:
            c, cc = self.pre_conv(self.pre_conv_norm(x), state.pre_conv, True)
            x = x + c
        h, ms = self.mixer.step(self.mixer_norm(x), state.mixer, **self.mixer_kw(position_ids))
        x = x + h
        if self.mlp is not None:
            x = x + self.mlp(self.mlp_norm(x))
        return x, BlockState(mixer=ms, pos=ms.pos, pre_conv=cc)


class LMHead(nn.Linear):
    """The output projection h → logits; given labels, the mean cross-entropy of those logits
    instead, ``chunk_size`` tokens at a time without forming them all (``linear_cross_entropy``;
    ``chunk_size`` 0: the full logits and F.cross_entropy). The loss is computed inside this
    module's call, so wrappers that gather a module's parameters around its forward (ZeRO-3) see it."""

    def __init__(self, d_model: int, vocab_size: int, chunk_size: int):
        super().__init__(d_model, vocab_size, bias=False)
        self.chunk_size = chunk_size

    def forward(self, h: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        if labels is None:
            return super().forward(h)
        if self.chunk_size == 0:
            return plain_cross_entropy(super().forward(h), labels, ignore_index=-100)
        return linear_cross_entropy(h, self.weight, labels, ignore_index=-100, chunk_size=self.chunk_size)


def model_class(cfg: ModelConfig) -> type:
    """The class ``LM(cfg)`` builds: ``LM``, or the model variant (a direct subclass) whose
    ``builds(cfg)`` says it builds ``cfg`` — with ``model.ttt_e2e.enabled`` the TTT-E2E model
    ``ttt_lm.model.e2e.E2ELM``, which the package ``ttt_lm.model`` imports — so every caller of
    ``LM(cfg)`` (trainer, evals, export, tools) runs it unchanged."""
    return next((c for c in LM.__subclasses__() if c.builds(cfg)), LM)


class LM(nn.Module):
    #: whether prefill / step / generate run (a model variant without carried states says False)
    supports_decode = True
    #: whether the blocks are built from model.layer_pattern (a model variant with blocks of its own says False)
    reads_layer_pattern = True
    #: whether the blocks may call kernels/ ops (a model variant in plain PyTorch says False)
    runs_kernel_ops = True
    #: whether a preset's size in its name (``_125m``) is its parameter count; a variant whose
    #: presets take a paper's size names for other counts says False
    size_names_count_params = True
    #: a model variant with blocks of its own: the ``model.init`` scheme its presets take (None:
    #: gpt2, or no scheme read); the layer kinds' ``Mixer.official_init`` say it for the others
    official_init: Optional[str] = None

    def __new__(cls, cfg: Optional[ModelConfig] = None, *args, **kwargs):
        return super().__new__(model_class(cfg) if cls is LM else cls)

    @classmethod
    def builds(cls, cfg: Optional[ModelConfig]) -> bool:
        """Whether ``LM(cfg)`` builds this class (a model variant says so for its configs)."""
        return False

    @classmethod
    def few_layer_overrides(cls, cfg: ModelConfig, n_layers: int) -> list:
        """Overrides (``model.<field>=<value>``) that make ``cfg`` a model of this class with about
        ``n_layers`` blocks that still runs every path the class has: the numerical-health tests
        run each preset so, at its own width and sequence length. Here ``n_layers`` itself."""
        return [f"model.n_layers={n_layers}"]

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if getattr(getattr(cfg, "ttt_e2e", None), "enabled", False):
            raise ValueError(f"{type(self).__name__} does not run TTT-E2E (model.ttt_e2e.enabled=true): "
                             "build it with LM(cfg); its tensor- and context-parallel forms are not built yet")
        cfg.validate()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size, cfg.loss_chunk_size)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        init_weights(self, cfg.init_std, cfg.n_layers, cfg.init, n_residuals_per_layer=2 if cfg.ff > 0 else 1)
        self.set_kernel_backend(cfg.kernel_backend)
        #: run each block under activation checkpointing in training (set by the trainer)
        self.activation_checkpointing = False

    # ---- configuration switches --------------------------------------------------------------
    def set_impl(self, impl: str) -> "LM":
        """"chunked" (training form, default) or "reference" (sequential forms) for every mixer."""
        for b in self.layers:
            b.mixer.impl = impl
        return self

    def set_train_step(self, step: int) -> "LM":
        """Tell the layers with a training schedule of their own which optimizer step (1-based)
        comes next: TTT's inner base learning-rate warmup (``model.ttt.base_lr_init``)."""
        for b in self.layers:
            b.mixer.set_train_step(step)
        return self

    def set_kernel_backend(self, backend: str) -> "LM":
        for b in self.layers:
            b.mixer.kernel_backend = backend
        return self

    def compile_blocks(self, backend: Optional[str] = None) -> "LM":
        """``torch.compile`` each block in place (``nn.Module.compile``: parameter names and the
        state dict are unchanged, so checkpoints load either way); the embedding, final norm, head
        and loss stay eager. The Triton ops in ``kernels/`` are ``torch.library`` custom ops: a
        block's graph holds its op as one opaque node (no graph break), and the projections, norms,
        gates and MLP around it are compiled. The PyTorch chunked forms (``kernel_backend=torch``,
        the CPU path) are traced like any other code. Compilation happens at a block's first call."""
        backend = backend or self.cfg.compile_backend
        for b in self.layers:
            b.compile(backend=backend)
        return self

    def kernel_backends(self, device) -> Dict[str, str]:
        """Per layer kind, what its chunked form runs on ``device`` ("cuda" or "cpu"; no tensor
        needed): "triton" (a kernel in ``kernels/``), "torch" (the PyTorch chunked form), or for
        attention "attention:<attention.backend>". With ``kernel_backend=triton`` a layer that no
        kernel covers raises a ValueError naming its kind."""
        out: Dict[str, str] = {}
        for i, b in enumerate(self.layers):
            m = b.mixer
            if not m.uses_kernel_op:
                out[b.kind] = f"attention:{m.requested_backend()}"
                continue
            try:
                out[b.kind] = str(m.resolve_backend(device))
            except ValueError as e:
                raise ValueError(f"layer kind {b.kind!r} (layer {i}): {e}") from None
        return out

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # tied weights are counted once
        if exclude_embeddings:
            n -= self.embed.weight.numel()
            if not self.cfg.tie_embeddings:
                n -= self.lm_head.weight.numel()
        return n

    # ---- forward -----------------------------------------------------------------------------
    def init_states(self, batch_size: int, device=None, dtype=None) -> List[BlockState]:
        return [b.init_state(batch_size, device, dtype) for b in self.layers]

    def hidden(self, input_ids: torch.Tensor, states=None, output_states: bool = False,
               position_ids: Optional[torch.Tensor] = None):
        """The blocks' output (final-normed) and the new states. ``position_ids`` [B, T]: checked and,
        with resets, turned into the batch's ``DocLayout`` once, on the host: positions on the CPU
        (the loader's) cost no device→host read at all (the layout's tensors reach the device in
        non-blocking copies and its views take their sizes from its host copies); positions on a
        device are read back once (one synchronization), then the same."""
        docs = None
        if position_ids is not None:
            if tuple(position_ids.shape) != tuple(input_ids.shape):
                raise ValueError(f"position_ids must be [B, T] = {tuple(input_ids.shape)} like input_ids, "
                                 f"got {tuple(position_ids.shape)}")
            # checked (and the layout built) on the host, once per batch
            host = position_ids if position_ids.device.type == "cpu" else position_ids.cpu()
            layout = DocLayout.build(host)
            position_ids = host_to_device(position_ids, input_ids.device)
            if not (self.cfg.reset_at_doc_boundaries and layout.inner_starts):
                pass  # no document starts inside a row, or no resets: one plain batched pass
            elif states is not None or output_states:
                raise ValueError("resetting at document boundaries (model.reset_at_doc_boundaries with "
                                 "position_ids) cannot be combined with carried states")
            else:
                docs = layout.to(input_ids.device, position_ids=position_ids)
        x = self.embed(input_ids)
        new_states = [] if output_states else None
        for i, block in enumerate(self.layers):
            st = None if states is None else states[i]
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                x, ns = torch.utils.checkpoint.checkpoint(block, x, st, output_states, docs, position_ids,
                                                          use_reentrant=False)
            else:
                x, ns = block(x, st, output_states, docs, position_ids)
            if output_states:
                new_states.append(ns)
        return self.norm(x), new_states

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                states=None, output_states: bool = False,
                position_ids: Optional[torch.Tensor] = None) -> LMOutput:
        """position_ids [B, T] (0 at a document's first token): segment positions for the mixers
        that read them (RG-LRU), and document resets with model.reset_at_doc_boundaries. With
        ``labels`` the output has the loss and no logits (module docstring)."""
        h, new_states = self.hidden(input_ids, states, output_states, position_ids)
        if labels is not None:
            loss = self.lm_head(h, labels) if isinstance(self.lm_head, LMHead) else \
                plain_cross_entropy(self.lm_head(h), labels)  # a head swapped in from outside
            return LMOutput(logits=None, loss=loss, states=new_states)
        return LMOutput(logits=self.lm_head(h), states=new_states)

    def step(self, token_ids: torch.Tensor, states: List[BlockState], position_ids: Optional[torch.Tensor] = None):
        """One decode step: token_ids [B] → logits [B, V] and the new states. ``position_ids``
        [B]: the tokens' segment positions (0 starts a new document: the RG-LRU drops its
        state); by default each state's own position."""
        h, new_states = self._step_blocks(token_ids, states, position_ids)
        return self.lm_head(h)[:, 0], new_states

    def _step_blocks(self, token_ids: torch.Tensor, states: List[BlockState],
                     position_ids: Optional[torch.Tensor] = None):
        """The blocks of one decode step: token_ids [B] → the final-normed hidden state
        [B, 1, D] and the new states (``step`` without the head; the tensor-parallel model
        runs its own head on it)."""
        x = self.embed(token_ids[:, None])
        pos = None if position_ids is None else position_ids.reshape(-1, 1)
        new_states = []
        for block, st in zip(self.layers, states):
            x, ns = block.step(x, st, pos)
            new_states.append(ns)
        return self.norm(x), new_states

    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor, prefill_chunk: Optional[int] = PREFILL_CHUNK):
        """Read the prompt prompt_ids [B, T0]: (the logits [B, V] of its last position, every layer's
        state after it), what :meth:`generate` decodes from.

        The prompt is read ``prefill_chunk`` tokens at a time (None: in one pass), each piece one
        forward with the states the previous piece returned (attention's KV cache, the recurrent
        and fast-weight states, the pre-conv caches): for pieces x_1 … x_n of the prompt,

            S_0 = initial state,    (h_i, S_i) = blocks(x_i; S_{i−1}),    logits = head(h_n[:, −1])

        which equals one pass over the prompt (every mixer's forward from a carried state continues
        it exactly, at any piece length: pieces need not be multiples of a chunk, mini-batch or
        segment size; ``tests/model/test_chunked_prefill.py`` holds every registered kind to this).
        Only the last position's logits are formed, and a state tensor that is a view into a
        larger one (a short convolution's cache sliced from a piece's activations, the last w − 1
        keys of a piece's) is copied out of it (:func:`_own_storage`), so the memory of the prefill
        is that of one piece's activations plus the states, and the decode state holds no more: flat in the prompt length for the recurrent layers
        (a global attention layer's KV cache still grows with it). A subclass with its own
        ``forward`` (the tensor-parallel LM) runs that forward per piece and keeps its last logits.
        Refused before any work (ValueError naming the value): a ``prefill_chunk`` below 1, a
        prompt that is not [B, T0] integer ids in [0, ``model.vocab_size``) (:func:`check_prompt_ids`)."""
        check_prefill_chunk(prefill_chunk)
        check_prompt_ids(prompt_ids, self.cfg.vocab_size)
        T0 = prompt_ids.shape[1]
        n = T0 if prefill_chunk is None else prefill_chunk
        own_forward = type(self).forward is not LM.forward
        states, logits = None, None
        for s in range(0, T0, n):
            piece, last = prompt_ids[:, s:s + n], s + n >= T0
            if own_forward:
                out = self(piece, states=states, output_states=True)
                states, logits = out.states, (out.logits[:, -1] if last else None)
                del out
            else:
                h, states = self.hidden(piece, states, output_states=True)
                if last:
                    logits = self.lm_head(h[:, -1:])[:, 0]
                del h
        return logits, [st.map(_own_storage) for st in states]

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 top_p: Optional[float] = None, eos_id: Optional[int] = None,
                 vocab_size: Optional[int] = None, prefill_chunk: Optional[int] = PREFILL_CHUNK) -> torch.Tensor:
        """Sample continuations of prompt_ids [B, T0]; returns [B, T0 + n], n <= max_new_tokens.

        The prompt is read by :meth:`prefill`, ``prefill_chunk`` tokens per forward pass with every
        layer's state carried from piece to piece (None: one pass); each new token is then one
        :meth:`step` with those states (the mixers' decode forms: KV caches for attention, the
        recurrent or fast-weight state for the others), so a token costs the same at any position
        for the recurrent layers, and a recurrent model reads a prompt of any length in the memory
        of one piece. The default, ``PREFILL_CHUNK`` = 2048 tokens, is the training length of every
        preset but LaCT's (32,768): a piece costs what a training-length forward costs, without its
        [B, T, V] logits, and prompts up to that length are read in one pass as before. It is also
        a multiple of every preset's chunk, mini-batch and segment size (16, 64, 512, 2048), so
        every piece but the last is whole chunks; exactness does not need that (:meth:`prefill`).

        Sampling: :func:`sample_next` (temperature, then top-k, then top-p; temperature 0 is
        greedy). With ``eos_id`` a row that emits it is finished: its later positions hold
        ``eos_id``, and generation ends when every row is finished (n can then be below
        max_new_tokens). With
        ``vocab_size`` (the tokenizer's, when the model's vocabulary is padded beyond it) only ids
        below it are drawn (:func:`mask_vocab`), and a prompt id at or above it is refused.
        Refused with a ValueError naming the value, before any work: a ``prefill_chunk`` below 1,
        a prompt id below 0 or at or above ``vocab_size`` (or ``model.vocab_size``), sampling
        settings that mean nothing."""
        check_sampling(temperature, top_k, top_p)
        check_vocab_limit(vocab_size, self.cfg.vocab_size)
        if vocab_size is not None:
            check_prompt_ids(prompt_ids, vocab_size, "vocab_size")
        logits, states = self.prefill(prompt_ids, prefill_chunk)
        toks = [prompt_ids]
        done = torch.zeros(prompt_ids.shape[0], dtype=torch.bool, device=prompt_ids.device)
        for i in range(max_new_tokens):
            nxt = sample_next(logits, temperature, top_k, generator, top_p, vocab_size)
            if eos_id is not None:
                nxt = nxt.masked_fill(done, eos_id)
                done = done | (nxt == eos_id)
            toks.append(nxt[:, None])
            if i + 1 < max_new_tokens and not bool(done.all()):
                logits, states = self.step(nxt, states)
            else:
                break
        return torch.cat(toks, dim=1)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied when it is a view that keeps alive a storage more than twice its size (and
    4 KiB) larger: what a state keeps after the prefill is then its own size. Attention's KV
    buffer (at most twice the keys it holds, so that decode steps append in place) stays."""
    return t.clone() if t.untyped_storage().nbytes() > 2 * t.numel() * t.element_size() + 4096 else t


def check_prefill_chunk(prefill_chunk: Optional[int]) -> None:
    """Refuse a prefill piece length that is not a whole number of tokens >= 1 (None: one pass)."""
    if prefill_chunk is None:
        return
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, numbers.Integral) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk (prompt tokens per forward pass) must be an integer >= 1, or None for "
                         f"one pass, got {prefill_chunk!r}")


def check_prompt_ids(prompt_ids: torch.Tensor, model_vocab: int, limit: str = "model.vocab_size") -> None:
    """Refuse a prompt that is not [B, T0] integer token ids (B, T0 >= 1) in [0, model_vocab) (the
    embedding's rows, an id beyond them would index out of range, on a GPU with no clear error; or
    the tokenizer's ``vocab_size`` that ``generate`` is given, ``limit`` naming which). The message
    names the first offending id, its row and position, and the limit."""
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2 or 0 in prompt_ids.shape:
        shape = tuple(prompt_ids.shape) if isinstance(prompt_ids, torch.Tensor) else type(prompt_ids).__name__
        raise ValueError(f"prompt_ids must be a [B, T0] tensor of token ids with B >= 1 and T0 >= 1, got {shape}")
    if prompt_ids.dtype.is_floating_point or prompt_ids.dtype.is_complex or prompt_ids.dtype == torch.bool:
        raise ValueError(f"prompt_ids must hold integer token ids, got dtype {prompt_ids.dtype}")
    bad = (prompt_ids < 0) | (prompt_ids >= model_vocab)
    if bool(bad.any()):
        r, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"prompt token id {int(prompt_ids[r, t])} (row {r}, position {t}) is outside "
                         f"[0, {limit}={model_vocab})")


def check_sampling(temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None) -> None:
    """Refuse sampling settings that mean nothing, naming the argument."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 (or None for no limit), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (or None for no limit), got {top_p}")


def check_vocab_limit(vocab_size: Optional[int], model_vocab: int) -> None:
    """Refuse a token limit that is not a vocabulary the model's can hold: 1 <= vocab_size <= model_vocab."""
    if vocab_size is not None and not 1 <= vocab_size <= model_vocab:
        raise ValueError(f"vocab_size (the ids generation may produce) must be in [1, model.vocab_size={model_vocab}], "
                         f"got {vocab_size}")


def mask_vocab(logits: torch.Tensor, vocab_size: Optional[int]) -> torch.Tensor:
    """``logits`` [..., V] with every id >= ``vocab_size`` set to -inf, so that argmax and sampling
    never give an id the tokenizer cannot decode when the model's vocabulary is padded beyond the
    tokenizer's (V > vocab_size). Unchanged (the same tensor) when ``vocab_size`` is None or >= V."""
    if vocab_size is None or vocab_size >= logits.shape[-1]:
        return logits
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    out = logits.clone()
    out[..., vocab_size:] = float("-inf")
    return out


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                  top_p: Optional[float] = None) -> torch.Tensor:
    """The logits [B, V] that sampling draws from, in float32: divided by ``temperature`` (> 0),
    then every token outside the ``top_k`` largest set to -inf, then top-p (nucleus sampling,
    Holtzman et al. 2020): of the remaining distribution p (sorted, descending) the smallest
    prefix whose mass reaches ``top_p`` is kept, i.e. token i (in sorted order) is dropped when
    p_1 + … + p_{i-1} >= top_p; the most likely token is always kept. This is the order and rule of
    Hugging Face's TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper. Ties at the
    k-th value are all kept."""
    check_sampling(temperature, top_k, top_p)
    logits = logits.float() / max(temperature, 1e-12)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        p_sorted, order = logits.softmax(-1).sort(-1, descending=True)
        before = p_sorted.cumsum(-1) - p_sorted  # mass of the tokens ranked above each one
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                generator: Optional[torch.Generator] = None, top_p: Optional[float] = None,
                vocab_size: Optional[int] = None) -> torch.Tensor:
    """One token per row of logits [B, V]: argmax when temperature is 0, else a draw from
    softmax(:func:`filter_logits`); with ``vocab_size`` only ids below it (:func:`mask_vocab`)."""
    logits = mask_vocab(logits, vocab_size)
    if temperature <= 0:
        check_sampling(temperature, top_k, top_p)
        return logits.argmax(-1)
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def build_model(cfg: ModelConfig) -> LM:
    return LM(cfg)
