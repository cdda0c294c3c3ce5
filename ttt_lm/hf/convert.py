"""Write a :class:`ttt_lm.model.LM` as a Hugging Face folder, and read one back.

A Hugging Face export folder::

    config.json               TTTLMConfig: the ModelConfig under "ttt_lm", auto_map, eos/bos ids
    model.safetensors         the weights, named "model.<our name>" (a tied LM head is left out)
    generation_config.json    eos_token_id, so generate stops at the end-of-document token
    configuration_ttt_lm.py   copied from ttt_lm/hf by save_pretrained (trust_remote_code)
    modeling_ttt_lm.py
    tokenizer.json + tokenizer_config.json   a Hugging Face tokenizer, copied as it is, with its
                              eos/bos tokens (AutoTokenizer reads the pair), or
    tokenizer.model           a SentencePiece model, copied as it is (AutoTokenizer reads it too)

The weights are written and read by transformers (``save_pretrained`` / ``from_pretrained``),
so they are bit-identical both ways; :func:`load_hf` refuses a weight file it cannot read
(truncated, say) and a folder whose tensors do not match its config (missing, unexpected or
misshapen), naming them; the loaded tensors get memory of their own
(``TTTLMForCausalLM.from_pretrained``), so that the LM computes bit-identically to the one saved.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import Optional

import torch

from ttt_lm.hf.configuration_ttt_lm import TTTLMConfig
from ttt_lm.hf.modeling_ttt_lm import TTTLMForCausalLM

HF_CONFIG = "config.json"
SP_TOKENIZER = "tokenizer.model"
HF_TOKENIZER = "tokenizer.json"


#: the files an export writes (save_pretrained's, the tokenizer's): replaced when a folder is
#: exported again, so no file of the earlier export stays beside the new one
_OWN_FILE = re.compile(r"^(?:config\.json|generation_config\.json|model(?:-\d+-of-\d+)?\.safetensors"
                       r"|model\.safetensors\.index\.json|(?:configuration|modeling)_ttt_lm\.py"
                       r"|tokenizer\.(?:json|model)|tokenizer_config\.json|special_tokens_map\.json)$")


class HFError(ValueError):
    """A Hugging Face folder that cannot be written or read; the message names it."""


def hf_config(model_cfg, eos_id: Optional[int] = None, bos_id: Optional[int] = None) -> TTTLMConfig:
    """The :class:`TTTLMConfig` of a :class:`ttt_lm.model.ModelConfig`."""
    from ttt_lm.model.config import model_config_dict
    return TTTLMConfig(ttt_lm=model_config_dict(model_cfg), eos_token_id=eos_id,
                       bos_token_id=bos_id)


def _check_out_dir(out_dir: str) -> None:
    """Refuse to write into a folder holding something other than a ttt-lm Hugging Face export."""
    if not os.path.isdir(out_dir) or not os.listdir(out_dir):
        return
    cfg = os.path.join(out_dir, HF_CONFIG)
    try:
        with open(cfg) as f:
            ours = json.load(f).get("model_type") == TTTLMConfig.model_type
    except (OSError, ValueError, AttributeError):
        ours = False
    if not ours:
        few = ", ".join(sorted(os.listdir(out_dir))[:5])
        raise HFError(f"{out_dir} is not empty and is not a ttt-lm Hugging Face export (it holds {few}); "
                      "choose another output folder")


def save_hf(lm, out_dir: str, tokenizer: Optional[str] = None) -> str:
    """Write ``lm`` (a :class:`ttt_lm.model.LM`) into ``out_dir`` as a Hugging Face folder, with
    ``tokenizer`` (a ``tokenizer.json`` or SentencePiece ``.model`` file) beside it; the
    tokenizer's end-of-document id becomes the config's ``eos_token_id``, and a model vocabulary
    padded beyond the tokenizer's puts the padding ids in generation_config.json's
    ``suppress_tokens`` (transformers' generate never produces them). The folder is written
    in a temporary sibling and moved into place file by file, so a failed export leaves what
    was there."""
    from ttt_lm.data.manifest import vocab_fits
    from ttt_lm.data.tokenizer import open_tokenizer
    _check_out_dir(out_dir)
    tok = open_tokenizer(tokenizer) if tokenizer is not None else None
    if tok is not None and not vocab_fits(lm.cfg.vocab_size, tok.vocab_size, allow_padding=True):
        raise HFError(f"tokenizer {tokenizer} has {tok.vocab_size} tokens but the model's vocab_size is "
                      f"{lm.cfg.vocab_size}")
    eos = tok.eos_id if tok is not None else None
    bos = tok.bos_id if tok is not None and tok.bos_id is not None and tok.bos_id >= 0 else None
    config = hf_config(lm.cfg, eos, bos)
    dtype = lm.embed.weight.dtype
    with torch.device("meta"):
        hf = TTTLMForCausalLM(config)
    hf.model = lm  # the same modules: the weights written are exactly lm's
    hf.config.dtype = str(dtype).replace("torch.", "")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".hf_export_", dir=parent)
    try:
        hf.save_pretrained(tmp)
        if hf.generation_config is not None and tok is not None:
            if eos is not None:
                hf.generation_config.eos_token_id = eos
            if tok.vocab_size < lm.cfg.vocab_size:
                # the padding ids beyond the tokenizer's vocabulary: generate never produces them
                hf.generation_config.suppress_tokens = list(range(tok.vocab_size, lm.cfg.vocab_size))
            hf.generation_config.save_pretrained(tmp)
        if tok is not None and tok.kind == "hf":  # the file as it is, and what AutoTokenizer needs beside it
            tok.save_copy(os.path.join(tmp, HF_TOKENIZER))
        elif tok is not None:
            shutil.copyfile(tok.path, os.path.join(tmp, SP_TOKENIZER))
        os.makedirs(out_dir, exist_ok=True)
        new = sorted(os.listdir(tmp))
        for name in new:
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
        for name in os.listdir(out_dir):  # what an earlier export wrote and this one did not
            if name not in new and _OWN_FILE.match(name):
                os.remove(os.path.join(out_dir, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def read_hf_config(path: str) -> TTTLMConfig:
    cfg = os.path.join(path, HF_CONFIG)
    if not os.path.isfile(cfg):
        raise HFError(f"{path} is not a Hugging Face model folder: {cfg} does not exist")
    try:
        with open(cfg) as f:
            raw = json.load(f)
    except ValueError as e:
        raise HFError(f"{cfg} is not valid JSON: {e}") from e
    if raw.get("model_type") != TTTLMConfig.model_type:
        raise HFError(f"{cfg}: model_type is {raw.get('model_type')!r}, not {TTTLMConfig.model_type!r}: only ttt-lm "
                      "models (written by save_hf / export --format hf) can be imported")
    try:
        return TTTLMConfig.from_pretrained(path)
    except ValueError as e:
        raise HFError(f"{cfg}: {e}") from e


_WEIGHT_FILE = re.compile(r"^model(?:-\d+-of-\d+)?\.safetensors$")


def check_weight_files(path: str) -> None:
    """Open the header of every ``model*.safetensors`` in ``path``: safetensors checks there that
    its tensors cover the file exactly, so a truncated (or extended) file is refused here, naming
    it, rather than deep inside transformers' loader with safetensors' own message."""
    from safetensors import SafetensorError, safe_open
    for name in sorted(os.listdir(path)):
        if not _WEIGHT_FILE.match(name):
            continue
        f = os.path.join(path, name)
        try:
            with safe_open(f, framework="pt") as st:
                st.keys()
        except (SafetensorError, OSError) as e:
            raise HFError(f"{f} is not a readable safetensors file ({size_of(f)} bytes; {e}): the copy is "
                          f"truncated or damaged; copy or export the folder again") from None


def size_of(f: str) -> str:
    try:
        return f"{os.path.getsize(f):,}"
    except OSError:
        return "?"


def load_hf(path: str):
    """The :class:`ttt_lm.model.LM` of a Hugging Face folder written by :func:`save_hf`, on CPU,
    in eval mode, in the dtype its weights were saved in, its tensors in memory of their own
    (``TTTLMForCausalLM.from_pretrained``: bit-identical to the LM that was saved). A weight file
    that cannot be read (truncated, say) is refused naming it."""
    config = read_hf_config(path)
    check_weight_files(path)
    from safetensors import SafetensorError
    try:
        hf, info = TTTLMForCausalLM.from_pretrained(path, config=config, output_loading_info=True,
                                                    dtype=getattr(config, "dtype", None) or torch.float32)
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:
        raise HFError(f"cannot read the weights in {path}: {type(e).__name__}: {e}") from e
    tied = {"model.lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(set(info.get("missing_keys", ())) - tied)
    problems = []
    if missing:
        problems.append(f"missing {missing[:4]}")
    if info.get("unexpected_keys"):
        problems.append(f"unexpected {sorted(info['unexpected_keys'])[:4]}")
    if info.get("mismatched_keys"):
        problems.append(f"shape mismatch {list(info['mismatched_keys'])[:4]}")
    if problems:
        raise HFError(f"the weights in {path} do not match its config.json: " + "; ".join(problems))
    return hf.model.eval()
