"""Loading a trained model for evaluation.

An **export directory** (``model.pt`` + ``config.yaml`` + the tokenizer; the format is defined,
written and read in :mod:`ttt_lm.artifacts`) is what every eval reads.
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

from ttt_lm import artifacts
from ttt_lm.artifacts import CONFIG, TOKENIZER, ArtifactError, read_export, tokenizer_file, weights_file
from ttt_lm.eval.common import EvalError
from ttt_lm.model import LM

@dataclass
class Checkpoint:
    """A model together with what was recorded beside it."""
    model: LM
    path: str                          # the export directory it was read from (as given)
    name: str                          # a short label for tables and plot legends
    data_path: Optional[str] = None    # data.path of the experiment config, if there was one
    tokenizer_path: Optional[str] = None
    train_len: Optional[int] = None    # data.seq_len of the experiment config: the context it was trained at


def _is_training_checkpoint(d: str) -> bool:
    return (os.path.isdir(os.path.join(d, "checkpoints")) or os.path.isfile(os.path.join(d, "latest"))
            or os.path.isdir(os.path.join(d, "ds")))


def _load_export(d: str, device, dtype, name: Optional[str]) -> Checkpoint:
    try:
        model, data_path, train_len = read_export(d)
    except ArtifactError as e:
        raise EvalError(str(e)) from e
    model = model.to(device=device, dtype=dtype).eval()
    tok = tokenizer_file(d)
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
            and weights_file(d) is None)


def _load_hf_folder(d: str, device, dtype, name: Optional[str]) -> Checkpoint:
    try:
        from ttt_lm.hf import HFError, load_hf
    except ImportError as e:
        raise EvalError(f"{d} is a Hugging Face folder; reading it needs the hf extra: {e}") from e
    try:
        model = load_hf(d)
    except HFError as e:
        raise EvalError(str(e)) from e
    tok = tokenizer_file(d)
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
    if weights_file(path) is None and _is_training_checkpoint(path):
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
    """Write ``model`` as an export directory (used by tests and by the synthetic runs); without
    ``experiment_cfg`` the config holds the model's and defaults."""
    from ttt_lm.config import ExperimentConfig
    cfg = experiment_cfg if experiment_cfg is not None else ExperimentConfig(model=model.cfg)
    return artifacts.save_export(model, cfg, out_dir)
