"""Saved-model artifacts: the export directory that ``python -m ttt_lm.train.export`` writes and
every reader (the evals, ``load_pretrained``, ``train.init_from``, ``ttt_lm.convert``) reads::

    <dir>/model.pt       torch.save(model.state_dict()): the LM's full, consolidated state dict
                         (fp32 or any float dtype; a dict {"model": state_dict} is accepted too;
                         "module." / "_orig_mod." prefixes from DDP / torch.compile are stripped;
                         model.pth or pytorch_model.bin are read under those names)
    <dir>/config.yaml    the experiment config (ttt_lm.config.save_config) — its ``model`` section
                         builds the LM and its ``data.path`` names the default data and tokenizer —
                         or a bare ModelConfig YAML (the fields of ``model`` at the top level)
    <dir>/tokenizer.model  the SentencePiece model, or <dir>/tokenizer.json (with its
                         tokenizer_config.json) for data prepared with a Hugging Face tokenizer

The writer (:func:`save_export`) and the readers live here, so the format is defined once. A
file that cannot be used raises :class:`ArtifactError` naming it and why."""
from __future__ import annotations

import os
import shutil
from typing import Optional, Tuple

import torch

WEIGHTS = "model.pt"
#: weight file names a reader accepts, in order of preference (the writer writes the first)
WEIGHTS_FILES = (WEIGHTS, "model.pth", "pytorch_model.bin")
CONFIG = "config.yaml"
TOKENIZER = "tokenizer.model"
HF_TOKENIZER = "tokenizer.json"
TOKENIZERS = (TOKENIZER, HF_TOKENIZER)


class ArtifactError(ValueError):
    """A saved model that cannot be read; the message names the file and why."""


# ---- writing -----------------------------------------------------------------------------------

def save_export(model, cfg, out_dir: str, tokenizer: Optional[str] = None) -> str:
    """Write an export directory: ``model``'s state dict (renamed into place when complete), the
    experiment config ``cfg`` and, given a ``tokenizer`` file, its copy as ``tokenizer.model``
    (SentencePiece) or ``tokenizer.json`` with its ``tokenizer_config.json`` (Hugging Face)."""
    from ttt_lm.config import save_config
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, WEIGHTS + ".tmp")
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, os.path.join(out_dir, WEIGHTS))
    save_config(cfg, os.path.join(out_dir, CONFIG))
    if tokenizer is not None and tokenizer.endswith(".json"):
        from ttt_lm.data.tokenizer import open_tokenizer
        open_tokenizer(tokenizer).save_copy(os.path.join(out_dir, HF_TOKENIZER))
    elif tokenizer is not None:
        dst = os.path.join(out_dir, TOKENIZER)
        shutil.copyfile(tokenizer, dst + ".tmp")
        os.replace(dst + ".tmp", dst)
    return out_dir


# ---- reading -----------------------------------------------------------------------------------

def weights_file(d: str) -> Optional[str]:
    """The weights file of export directory ``d``, or None."""
    for w in WEIGHTS_FILES:
        if os.path.isfile(os.path.join(d, w)):
            return os.path.join(d, w)
    return None


def tokenizer_file(d: str) -> Optional[str]:
    """The tokenizer file stored in ``d``, or None."""
    return next((os.path.join(d, t) for t in TOKENIZERS if os.path.isfile(os.path.join(d, t))), None)


def read_config(path: str):
    """(ModelConfig, data path or None, training sequence length or None) from an experiment YAML or
    a bare model YAML."""
    from omegaconf import DictConfig, OmegaConf

    from ttt_lm.config import ConfigError, load_config
    from ttt_lm.model.config import model_config_from_dict
    try:
        raw = OmegaConf.load(path)
    except Exception as e:  # yaml syntax errors
        raise ArtifactError(f"{path}: cannot parse YAML: {e}") from e
    if not isinstance(raw, DictConfig):
        raise ArtifactError(f"{path}: expected a mapping, got {type(raw).__name__}")
    if "model" in raw:
        try:
            cfg = load_config(path)
        except ConfigError as e:
            raise ArtifactError(f"{path}: {e}") from e
        return cfg.model, cfg.data.path, cfg.data.seq_len
    try:
        mc = model_config_from_dict(OmegaConf.to_container(raw))
        return mc.validate(), None, None
    except Exception as e:  # noqa: BLE001 - omegaconf and validate errors alike name the key
        raise ArtifactError(f"{path}: not a model config: {e}") from e


def _clean_state_dict(sd: dict) -> dict:
    if "model" in sd and isinstance(sd["model"], dict):
        sd = sd["model"]
    out = {}
    for k, v in sd.items():
        for p in ("module.", "_orig_mod."):
            while k.startswith(p):
                k = k[len(p):]
        out[k] = v
    return out


def load_state_dict_checked(model, sd: dict, source: str) -> None:
    """load_state_dict that explains a mismatch: missing and unexpected keys and shape differences,
    a few of each, so "a checkpoint of another model" reads as such."""
    sd = _clean_state_dict(sd)
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    if model.cfg.tie_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    unexpected = [k for k in sd if k not in own]
    shapes = [f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
              for k in own if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        def few(xs):
            return ", ".join(xs[:4]) + (f", … ({len(xs)} in all)" if len(xs) > 4 else "")
        parts = []
        if missing:
            parts.append(f"missing {few(missing)}")
        if unexpected:
            parts.append(f"unexpected {few(unexpected)}")
        if shapes:
            parts.append(f"shape mismatch {few(shapes)}")
        raise ArtifactError(f"the weights in {source} do not belong to the model its config describes "
                            f"(layer pattern {model.cfg.layer_kinds()}, d_model={model.cfg.d_model}, "
                            f"vocab_size={model.cfg.vocab_size}): " + "; ".join(parts))
    if model.cfg.tie_embeddings and "lm_head.weight" not in sd:
        sd = dict(sd, **{"lm_head.weight": sd["embed.weight"]})
    model.load_state_dict(sd, strict=True)


def read_state_dict(d: str) -> Tuple[dict, str]:
    """(state dict, weights file) of export directory ``d``."""
    w = weights_file(d)
    if w is None:
        raise ArtifactError(f"{d} holds none of {list(WEIGHTS_FILES)} (write an export directory with "
                            "`python -m ttt_lm.train.export <run dir> <out dir>`)")
    try:
        sd = torch.load(w, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickle/zip errors alike
        raise ArtifactError(f"{w} cannot be read as a PyTorch state dict: {e}") from e
    if not isinstance(sd, dict):
        raise ArtifactError(f"{w} holds a {type(sd).__name__}, not a state dict")
    return sd, w


def read_export(d: str):
    """(LM on the CPU in train mode, the config's data.path or None, its data.seq_len or None) from
    export directory ``d``."""
    from ttt_lm.model import LM
    cfg_path = os.path.join(d, CONFIG)
    if not os.path.isfile(cfg_path) or weights_file(d) is None:
        raise ArtifactError(f"{d} is not an export directory: it needs {CONFIG} and one of {list(WEIGHTS_FILES)} "
                            f"(write one with `python -m ttt_lm.train.export <run dir> <out dir>`)")
    mcfg, data_path, train_len = read_config(cfg_path)
    model = LM(mcfg)
    sd, w = read_state_dict(d)
    load_state_dict_checked(model, sd, w)
    return model, data_path, train_len


def load_state_dict_into(model, out_dir: str) -> None:
    """Load the weights of export directory ``out_dir`` into ``model`` (``train.init_from``)."""
    sd, w = read_state_dict(out_dir)
    load_state_dict_checked(model, sd, w)


def load_pretrained(out_dir: str, map_location="cpu"):
    """The LM saved in export directory ``out_dir``, on the CPU, in eval mode. ``map_location`` is
    accepted for callers of the earlier signature; the weights are read on the CPU either way."""
    model, _, _ = read_export(out_dir)
    return model.eval()
