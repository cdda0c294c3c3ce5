"""A ttt-lm language model as a Hugging Face ``PreTrainedModel`` with ``GenerationMixin``.

``TTTLMForCausalLM.model`` is the :class:`ttt_lm.model.LM` itself (its parameters are named
``model.<our name>``), so logits are our LM's, computed by the same code. ``generate`` keeps
each layer's decode state in a :class:`TTTLMCache` (attention's KV cache, the recurrent or
fast-weight state of the other mixers, TTT's pre-conv cache): the prompt is read in one
forward pass that returns every layer's state, then each new token is one
:meth:`ttt_lm.model.LM.step`, as :meth:`ttt_lm.model.LM.generate` does.

What generation supports: greedy decoding and sampling (with transformers' logits processors),
batched prompts; the cache reorders its rows for beam search (``TTTLMCache.reorder_cache``:
``MixerState.index_select`` on every layer). The recurrent states have no notion of a masked
position, so a left-padded batch (an ``attention_mask`` with zeros) is generated row by row:
:meth:`TTTLMForCausalLM.generate` cuts each row's padding off, generates it alone and lays the
rows out as transformers lays out a padded batch (the padded prompts as given, then the new
tokens, rows that stop early filled with ``pad_token_id``), so each row gets exactly the tokens it
gets alone. A forward call with such a mask is refused with a message.

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


#: the name transformers gives the decode cache in model outputs and in the inputs generate hands the
#: model: ``cache`` from transformers 5.24 on, ``past_key_values`` before. The model takes either
#: name and returns the cache under this one (5.24's outputs still answer to ``past_key_values``).
CACHE_NAME = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


def _the_cache(cache, past_key_values):
    """The one cache passed as ``cache`` or by its older name ``past_key_values``, checked."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("two caches given: cache= and past_key_values= (its older name); pass one")
    c = cache if cache is not None else past_key_values
    if c is not None and not isinstance(c, TTTLMCache):
        raise ValueError(f"the cache (cache= or past_key_values=) must be the TTTLMCache a previous call returned, "
                         f"got {type(c).__name__}")
    return c


class TTTLMCache:
    """Every layer's decode state (a list of typed block states, ``ttt_lm.model.lm.BlockState``,
    as :meth:`LM.init_states` makes them) and how many tokens it has read. transformers'
    generate carries it between forward calls as ``cache`` (``past_key_values`` before
    transformers 5.24, see :data:`CACHE_NAME`); the model replaces ``states`` after each call."""

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

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' ``from_pretrained``, then every parameter and buffer copied into memory
        of its own. Loaded from ``model.safetensors`` each CPU tensor is a view into the file's
        memory map, where the format aligns a tensor's data to 8 bytes only; MKL's CPU matrix
        products round differently by the operands' alignment (without ``MKL_CBWR``), e.g. TTT's
        η = σ(θ_η·x) when θ_η sits 8 bytes off a 16-byte boundary, so the loaded model would not
        compute bit-identically to the one saved for every input. The copies (PyTorch's allocator
        aligns them to 64 bytes, as it did the saved model's) also detach the model from the
        file; a tied weight is one Parameter, copied once."""
        out = super().from_pretrained(*args, **kwargs)
        model = out[0] if isinstance(out, tuple) else out
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                t.data = t.data.clone(memory_format=torch.contiguous_format)
        return out

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
            raise ValueError("ttt-lm models take no padding in a forward call: the attention_mask has zeros, but the "
                             "recurrent layers read every position; generate() takes left-padded batches (it runs "
                             "padded rows one by one), or pass prompts of equal length")

    def generate(self, inputs: Optional[torch.Tensor] = None, generation_config=None, *args, **kwargs):
        """transformers' ``generate``; a left-padded batch (``attention_mask`` with zeros) is
        generated one row at a time, each row without its padding, and returned in the layout of
        a padded batch: ``[B·num_return_sequences, T + longest continuation]``, each row its
        padded prompt as given, its new tokens, then ``pad_token_id`` (the first
        ``eos_token_id`` when unset, as transformers does). ``max_length``/``min_length`` count
        the padded prompt, as in transformers. Greedy decoding and beam search give each row the
        tokens it gets alone; sampling draws each row in turn from the one random generator.
        Only the sequences are returned (``return_dict_in_generate`` is refused with padding)."""
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        mask = kwargs.get("attention_mask")
        if ids is None or mask is None or bool((mask != 0).all()):
            return super().generate(inputs, generation_config, *args, **kwargs)
        if ids.dim() != 2 or mask.shape != ids.shape:
            raise ValueError(f"attention_mask {tuple(mask.shape)} must have the shape of input_ids {tuple(ids.shape)}")
        real = mask != 0
        if not bool((real[:, 1:] >= real[:, :-1]).all()):
            raise ValueError("ttt-lm models take left padding only: every attention_mask row must be zeros (padding) "
                             "then ones (the prompt); a zero after a one is a gap the recurrent layers cannot skip")
        if not bool(real[:, -1].all()):
            raise ValueError("a row of the attention_mask is all zeros: a prompt needs at least one token")
        gc = generation_config if generation_config is not None else self.generation_config
        setting = lambda k: kwargs[k] if k in kwargs else getattr(gc, k, None)  # noqa: E731
        if setting("return_dict_in_generate"):
            raise ValueError("with a padded attention_mask, generate runs each row on its own and returns the "
                             "sequences only: return_dict_in_generate is not supported; generate rows separately")
        pad = setting("pad_token_id")
        if pad is None:
            eos = setting("eos_token_id")
            pad = eos[0] if isinstance(eos, (list, tuple)) else eos
            pad = int(pad.flatten()[0]) if torch.is_tensor(pad) else pad
        rest = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask")}
        rows = []
        for i in range(ids.shape[0]):
            p = int((~real[i]).sum())
            kw = dict(rest)
            if setting("max_new_tokens") is None and setting("max_length") is not None:
                kw["max_length"] = setting("max_length") - p  # transformers counts the padding in
            if setting("min_length"):
                kw["min_length"] = max(0, setting("min_length") - p)
            row = ids[i:i + 1, p:]
            out = super().generate(row, generation_config, *args, attention_mask=torch.ones_like(row), **kw)
            rows.append(torch.cat([ids[i:i + 1].expand(out.shape[0], -1), out[:, row.shape[1]:]], 1))
        width = max(r.shape[1] for r in rows)
        if any(r.shape[1] < width for r in rows) and pad is None:
            raise ValueError("the rows stopped at different lengths and neither pad_token_id nor eos_token_id is set "
                             "to fill the shorter ones: pass pad_token_id")
        return torch.cat([F.pad(r, (0, width - r.shape[1]), value=pad if pad is not None else 0) for r in rows], 0)

    def forward(self, input_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[TTTLMCache] = None, labels: Optional[torch.LongTensor] = None,
                use_cache: Optional[bool] = None, return_dict: Optional[bool] = None,
                cache: Optional[TTTLMCache] = None, **kwargs) -> CausalLMOutputWithPast:
        """Logits [B, T, V] of ``input_ids`` [B, T]; with ``cache`` (a :class:`TTTLMCache`; its
        older name ``past_key_values`` is accepted too) the tokens continue that state, and with
        ``use_cache`` the output carries the new state under :data:`CACHE_NAME`. ``labels`` [B, T]
        as in transformers: shifted inside."""
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("ttt-lm models take input_ids, not inputs_embeds")
        past_key_values = _the_cache(cache, past_key_values)
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
        new_cache = TTTLMCache(new_states, seen + input_ids.shape[1]) if use_cache else None
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_NAME: new_cache})

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, past_key_values: Optional[TTTLMCache] = None,
                                      attention_mask: Optional[torch.Tensor] = None, use_cache: bool = True,
                                      cache: Optional[TTTLMCache] = None, **kwargs) -> dict:
        """The tokens the cache has not read yet (all of them on the first call), with the cache
        (given as ``cache`` or ``past_key_values``, handed on as :data:`CACHE_NAME`)."""
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("ttt-lm models generate from input_ids, not inputs_embeds")
        self._check_mask(attention_mask)
        c = _the_cache(cache, past_key_values)
        if c is not None:
            input_ids = input_ids[:, c.seen_tokens:]
        return {"input_ids": input_ids, CACHE_NAME: c, "use_cache": use_cache}
