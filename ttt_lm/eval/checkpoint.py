"""Loading a trained model for evaluation.

An **export directory** is what every eval reads::

    <dir>/model.pt       torch.save(model.state_dict()): the LM's full, consolidated state dict
                         (fp32 or any float dtype; a dict {"model": state_dict} is accepted too;
                         "module." / "_orig_mod." prefixes from DDP / torch.compile are stripped)
    <dir>/config.yaml    the experiment config (ttt_lm.config.save_config) — its ``model`` section
                         builds the LM and its ``data.path`` names the default data and tokenizer —
                         or a bare ModelConfig YAML (the fields of ``model`` at the top level)
    <dir>/tokenizer.model  the SentencePiece model (``python -m ttt_lm.train.export`` copies the
                         run's), or <dir>/tokenizer.json for data prepared with a Hugging Face
                         tokenizer; without one the tokenizer comes from the config's data.path

``python -m ttt_lm.train.export <run> <dir>`` writes exactly this. A Hugging Face folder written by
``export --format hf`` (``config.json`` + ``model.safetensors``, see :mod:`ttt_lm.hf`) is read too.
A training run directory (``<run>/checkpoints/step_…``), a ``checkpoints/`` directory or one
``step_…`` checkpoint is also accepted: it is exported (ZeRO shards consolidated) into a temporary
directory first.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf

from ttt_lm.eval.common import EvalError
from ttt_lm.model import LM, ModelConfig

WEIGHTS = ("model.pt", "model.pth", "pytorch_model.bin")
CONFIG = "config.yaml"
TOKENIZER = "tokenizer.model"
TOKENIZERS = (TOKENIZER, "tokenizer.json")


@dataclass
class Checkpoint:
    """A model together with what was recorded beside it."""
    model: LM
    path: str                          # the export directory it was read from (as given)
    name: str                          # a short label for tables and plot legends
    data_path: Optional[str] = None    # data.path of the experiment config, if there was one
    tokenizer_path: Optional[str] = None
    train_len: Optional[int] = None    # data.seq_len of the experiment config: the context it was trained at


def _weights_file(d: str) -> Optional[str]:
    for w in WEIGHTS:
        if os.path.isfile(os.path.join(d, w)):
            return os.path.join(d, w)
    return None


def _is_training_checkpoint(d: str) -> bool:
    return (os.path.isdir(os.path.join(d, "checkpoints")) or os.path.isfile(os.path.join(d, "latest"))
            or os.path.isdir(os.path.join(d, "ds")))


def read_config(path: str):
    """(ModelConfig, data path or None, training sequence length or None) from an experiment YAML or
    a bare model YAML."""
    try:
        raw = OmegaConf.load(path)
    except Exception as e:  # yaml syntax errors
        raise EvalError(f"{path}: cannot parse YAML: {e}") from e
    if not isinstance(raw, DictConfig):
        raise EvalError(f"{path}: expected a mapping, got {type(raw).__name__}")
    from ttt_lm.config import ConfigError, load_config
    if "model" in raw:
        try:
            cfg = load_config(path)
        except ConfigError as e:
            raise EvalError(f"{path}: {e}") from e
        return cfg.model, cfg.data.path, cfg.data.seq_len
    try:
        mc = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw))
        return mc.validate(), None, None
    except Exception as e:  # noqa: BLE001 - omegaconf and validate errors alike name the key
        raise EvalError(f"{path}: not a model config: {e}") from e


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


def load_state_dict_checked(model: LM, sd: dict, source: str) -> None:
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
        raise EvalError(f"the weights in {source} do not belong to the model its config describes "
                        f"(layer pattern {model.cfg.layer_kinds()}, d_model={model.cfg.d_model}, "
                        f"vocab_size={model.cfg.vocab_size}): " + "; ".join(parts))
    if model.cfg.tie_embeddings and "lm_head.weight" not in sd:
        sd = dict(sd, **{"lm_head.weight": sd["embed.weight"]})
    model.load_state_dict(sd, strict=True)


def _load_export(d: str, device, dtype, name: Optional[str]) -> Checkpoint:
    cfg_path = os.path.join(d, CONFIG)
    w = _weights_file(d)
    if not os.path.isfile(cfg_path) or w is None:
        raise EvalError(f"{d} is not an export directory: it needs {CONFIG} and one of {list(WEIGHTS)} "
                        f"(write one with `python -m ttt_lm.train.export <run dir> <out dir>`)")
    mcfg, data_path, train_len = read_config(cfg_path)
    model = LM(mcfg)
    try:
        sd = torch.load(w, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickle/zip errors alike
        raise EvalError(f"{w} cannot be read as a PyTorch state dict: {e}") from e
    if not isinstance(sd, dict):
        raise EvalError(f"{w} holds a {type(sd).__name__}, not a state dict")
    load_state_dict_checked(model, sd, w)
    model = model.to(device=device, dtype=dtype).eval()
    tok = next((os.path.join(d, t) for t in TOKENIZERS if os.path.isfile(os.path.join(d, t))), None)
    if tok is None:
        if data_path and os.path.isfile(os.path.join(data_path, "manifest.json")):
            from ttt_lm.data import load_manifest
            tok = load_manifest(data_path, check_files=False)["tokenizer_path"]
    label = name or os.path.basename(os.path.normpath(d))
    return Checkpoint(model, d, label, data_path, tok, train_len)


def missing_tokenizer(ck: Checkpoint, flag: str = "--tokenizer") -> str:
    """Why ``ck`` has no tokenizer, and what to do: one sentence for an error message."""
    if ck.data_path and not os.path.isfile(os.path.join(ck.data_path, "manifest.json")):
        why = (f"{ck.path} holds no {TOKENIZER} and its config's data.path {ck.data_path!r} is not a prepared "
               f"data directory here (moved, or on another machine)")
    else:
        why = f"{ck.path} holds no {TOKENIZER} and its config names no prepared data"
    return (f"{why}; pass {flag} (a .model file or a prepared data dir), or export the run again with "
            f"`python -m ttt_lm.train.export <run dir> <out dir>`, which copies the tokenizer into the export")


def _is_hf_folder(d: str) -> bool:
    return (os.path.isfile(os.path.join(d, "config.json")) and not os.path.isfile(os.path.join(d, CONFIG))
            and _weights_file(d) is None)


def _load_hf_folder(d: str, device, dtype, name: Optional[str]) -> Checkpoint:
    try:
        from ttt_lm.hf import HFError, load_hf
    except ImportError as e:
        raise EvalError(f"{d} is a Hugging Face folder; reading it needs the hf extra: {e}") from e
    try:
        model = load_hf(d)
    except HFError as e:
        raise EvalError(str(e)) from e
    tok = next((os.path.join(d, t) for t in TOKENIZERS if os.path.isfile(os.path.join(d, t))), None)
    return Checkpoint(model.to(device=device, dtype=dtype).eval(), d, name or os.path.basename(os.path.normpath(d)),
                      None, tok)


def load_checkpoint(path: str, device="cpu", dtype: Optional[torch.dtype] = None,
                    name: Optional[str] = None) -> Checkpoint:
    """A :class:`Checkpoint` from an export directory, a Hugging Face folder (``export --format
    hf``), a run directory or a training checkpoint."""
    if not os.path.exists(path):
        raise EvalError(f"checkpoint {path} does not exist")
    if os.path.isfile(path):
        raise EvalError(f"checkpoint {path} is a file; pass the export directory holding it and {CONFIG}")
    if _is_hf_folder(path):
        return _load_hf_folder(path, device, dtype, name)
    if _weights_file(path) is None and _is_training_checkpoint(path):
        from ttt_lm.train.checkpoint import CheckpointError
        from ttt_lm.train.export import export
        tmp = tempfile.mkdtemp(prefix="ttt_lm_eval_export_")
        try:
            try:
                export(path, tmp, tokenizer=None)  # verifies the checkpoint's files first (ttt_lm.train.checkpoint.select)
            except CheckpointError as e:
                raise EvalError(str(e)) from e
            ck = _load_export(tmp, device, dtype, name or os.path.basename(os.path.normpath(path)))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        ck.path = path
        return ck
    return _load_export(path, device, dtype, name)


def load_model(path: str, device="cpu", dtype: Optional[torch.dtype] = None) -> LM:
    """The LM stored at ``path`` (an export directory: ``model.pt`` + ``config.yaml``, see the
    module docstring; or a run / training checkpoint directory), in eval mode on ``device``."""
    return load_checkpoint(path, device, dtype).model


def save_export(model: LM, out_dir: str, experiment_cfg=None) -> str:
    """Write ``model`` as an export directory (used by tests and by the synthetic runs)."""
    from ttt_lm.config import ExperimentConfig, save_config
    os.makedirs(out_dir, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(out_dir, WEIGHTS[0]))
    cfg = experiment_cfg if experiment_cfg is not None else ExperimentConfig(model=model.cfg)
    save_config(cfg, os.path.join(out_dir, CONFIG))
    return out_dir
