"""A ttt-lm language model as a Hugging Face ``PreTrainedModel`` with ``GenerationMixin``.

``TTTLMForCausalLM.model`` is the :class:`ttt_lm.model.LM` itself (its parameters are named
``model.<our name>``), so logits are our LM's, computed by the same code. ``generate`` keeps
each layer's decode state in a :class:`TTTLMCache` (attention's KV cache, the recurrent or
fast-weight state of the other mixers, TTT's pre-conv cache): the prompt is read in one
forward pass that returns every layer's state, then each new token is one
:meth:`ttt_lm.model.LM.step`, as :meth:`ttt_lm.model.LM.generate` does.

What generation supports: greedy decoding and sampling (with transformers' logits processors),
batched prompts of equal length; the cache reorders its rows for beam search
(``TTTLMCache.reorder_cache``: ``MixerState.index_select`` on every layer). Padded batches (an
``attention_mask`` with zeros) are refused with a message: the recurrent states have no notion
of a masked position.

``labels`` follow the transformers convention (the inputs themselves; the model shifts them),
unlike :meth:`ttt_lm.model.LM.forward`, which takes labels already aligned.

This file is copied into every Hugging Face export (``auto_map`` in config.json), and it
imports ``ttt_lm``: loading an export with ``trust_remote_code=True`` needs the package
installed.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ttt_lm.model.lm import LM, BlockState

from .configuration_ttt_lm import TTTLMConfig


class TTTLMCache:
    """Every layer's decode state (a list of typed block states, ``ttt_lm.model.lm.BlockState``,
    as :meth:`LM.init_states` makes them) and how many tokens it has read. transformers'
    generate carries it between forward calls as ``past_key_values``; the model replaces
    ``states`` after each call."""

    is_compileable = False

    def __init__(self, states: List[BlockState], seen_tokens: int):
        self.states = states
        self.seen_tokens = seen_tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Keep batch rows ``beam_idx`` of every state, in that order (beam search's reordering)."""
        self.states = [s.index_select(beam_idx) for s in self.states]


class TTTLMPreTrainedModel(PreTrainedModel):
    config_class = TTTLMConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _supports_cache_class = True

    def _init_weights(self, module):
        """LM.__init__ initializes every parameter with the scheme of model.init and a checkpoint
        overwrites them all; what from_pretrained leaves empty are the unsaved buffers, which
        each module that has one recomputes with its ``reset_buffers``."""
        if module is self or isinstance(module, PreTrainedModel):
            return
        own = [n for n, _ in module.named_buffers(recurse=False) if n in module._non_persistent_buffers_set]
        if own:
            if not hasattr(module, "reset_buffers"):
                raise TypeError(f"{type(module).__name__} has unsaved buffers {own} but no reset_buffers() to "
                                "recompute them after loading")
            module.reset_buffers()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # the decode state is our own TTTLMCache, made by the first forward call
        return False


class TTTLMForCausalLM(TTTLMPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}

    def __init__(self, config: TTTLMConfig):
        super().__init__(config)
        self.model = LM(config.model_config())
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    @staticmethod
    def _check_mask(attention_mask: Optional[torch.Tensor]) -> None:
        if attention_mask is not None and not bool((attention_mask != 0).all()):
            raise ValueError("ttt-lm models take no padding: the attention_mask has zeros, but the recurrent layers "
                             "read every position; pass prompts of equal length (or one prompt per call)")

    def forward(self, input_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[TTTLMCache] = None, labels: Optional[torch.LongTensor] = None,
                use_cache: Optional[bool] = None, return_dict: Optional[bool] = None,
                **kwargs) -> CausalLMOutputWithPast:
        """Logits [B, T, V] of ``input_ids`` [B, T]; with ``past_key_values`` (a
        :class:`TTTLMCache`) the tokens continue that state, and with ``use_cache`` the output
        carries the new state. ``labels`` [B, T] as in transformers: shifted inside."""
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("ttt-lm models take input_ids, not inputs_embeds")
        if past_key_values is not None and not isinstance(past_key_values, TTTLMCache):
            raise ValueError(f"past_key_values must be the TTTLMCache a previous call returned, got "
                             f"{type(past_key_values).__name__}")
        self._check_mask(attention_mask)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        states = None if past_key_values is None else past_key_values.states
        seen = 0 if past_key_values is None else past_key_values.seen_tokens
        if states is not None and input_ids.shape[1] == 1:
            logits, new_states = self.model.step(input_ids[:, 0], states)  # the decode form
            logits = logits[:, None]
        else:
            out = self.model(input_ids, states=states, output_states=use_cache)
            logits, new_states = out.logits, out.states
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        cache = TTTLMCache(new_states, seen + input_ids.shape[1]) if use_cache else None
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, past_key_values: Optional[TTTLMCache] = None,
                                      attention_mask: Optional[torch.Tensor] = None, use_cache: bool = True,
                                      **kwargs) -> dict:
        """The tokens the cache has not read yet (all of them on the first call), with the cache."""
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("ttt-lm models generate from input_ids, not inputs_embeds")
        self._check_mask(attention_mask)
        if past_key_values is not None:
            input_ids = input_ids[:, past_key_values.seen_tokens:]
        return {"input_ids": input_ids, "past_key_values": past_key_values, "use_cache": use_cache}
