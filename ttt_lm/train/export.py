"""Export a training checkpoint to a plain PyTorch state dict and its config.

    python -m ttt_lm.train.export runs/tiny/checkpoints/step_00000200 out/tiny
    python -m ttt_lm.train.export runs/tiny out/tiny          # the run's newest checkpoint
    python -m ttt_lm.train.export runs/tiny out/tiny-hf --format hf   # a Hugging Face folder

writes ``out/tiny/model.pt`` (the LM's full fp32 state dict, consolidated from the ZeRO shards with
DeepSpeed's zero_to_fp32, whatever the stage), ``out/tiny/config.yaml`` and
``out/tiny/tokenizer.model``: the SentencePiece model of the run's prepared data (the checkpoint
config's ``data.path``; ``--tokenizer PATH`` names another ``.model`` file or prepared directory);
data prepared with a Hugging Face ``tokenizer.json`` gives ``tokenizer.json`` and its
``tokenizer_config.json`` instead. ``--format hf`` writes a Hugging Face folder instead
(``model.safetensors``, ``config.json``, the modeling code; see :mod:`ttt_lm.hf`).
The tokenizer file is all a reader needs to encode and decode (its ids, the end-of-document id 2
and the byte fallback are inside it), so the export directory can be moved anywhere and evaluated
or sampled from without the data directory. The file must match the manifest's sha256, the
tokenizer sha256 the checkpoint recorded when it was trained, and the model's vocabulary. When the
data directory is not at hand, or holds another tokenizer, and no ``--tokenizer`` is given, the
export is written without one and says so; a ``--tokenizer`` that fails a check is an error. A checkpoint of a
tensor-parallel run (``parallel.tensor_parallel`` = p > 1) holds p slices of the model, DeepSpeed's
``…mp_rank_0r…`` files of TP rank r: each is consolidated on its own, then the slices are
concatenated along the dimension the checkpoint's ``partition_dims`` records for each parameter
(part by part for a fused one, recorded as [dimension, stride]; replicated ones, the norms' gains, are taken from TP rank 0). The result is the single-rank LM,
which ``train.init_from`` loads whatever tensor_parallel the new run uses.
``load_pretrained("out/tiny")`` returns the LM, on CPU, in eval mode. Needs no process group.
The checkpoint is verified first (``ttt_lm.train.checkpoint.select``): from a run directory the
newest checkpoint whose files match their recorded digests is exported, and a damaged step
directory is an error naming the file.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
import tempfile
from typing import Optional

import torch

from ttt_lm.artifacts import (CONFIG, HF_TOKENIZER, TOKENIZER, WEIGHTS, load_pretrained,  # noqa: F401 - the
                              load_state_dict_into, save_export)  # export format's readers, kept importable here
from ttt_lm.config import load_config

FORMATS = ("pt", "hf")


#: what DeepSpeed says, on every export, that is no news: the accelerator it settles on when it
#: finds no GPU (its auto-detection; consolidating a checkpoint runs on the CPU anyway)
_DS_NOISE = ("Setting accelerator to CPU",)


class _DropDeepSpeedNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n in record.getMessage() for n in _DS_NOISE)


@contextlib.contextmanager
def _quiet_deepspeed():
    """Around DeepSpeed's checkpoint reader: its accelerator line (a filter on its logger that drops
    that one message), zero_to_fp32's progress prints on stdout ("Processing zero checkpoint",
    "Parsing checkpoint created by", "Reconstructed fp32 state dict", ...) and its "Loading
    checkpoint shards" progress bar. Its other log records, Python warnings and exceptions pass
    as they are."""
    ds_logger = logging.getLogger("DeepSpeed")  # deepspeed.utils.logger: one logger by that name
    quiet = _DropDeepSpeedNoise()
    ds_logger.addFilter(quiet)
    try:
        import deepspeed.utils.zero_to_fp32 as z2f
        bar = z2f.tqdm
        z2f.tqdm = lambda it, *a, **k: it
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                yield z2f
        finally:
            z2f.tqdm = bar
    finally:
        ds_logger.removeFilter(quiet)


def _zero_fp32(ckpt_dir: str) -> dict:
    from ttt_lm.train.checkpoint import DS_TAG
    with _quiet_deepspeed() as z2f:
        sd = z2f.get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag=DS_TAG)
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}


def _tp_rank_state_dict(ckpt: str, tp_rank: int) -> dict:
    """TP rank r's slice of the model, consolidated over its ZeRO (data-parallel) shards.
    zero_to_fp32 reads only the ``mp_rank_00`` files, so rank r's files are shown to it under
    that name (symbolic links in a temporary directory)."""
    from ttt_lm.train.checkpoint import DS_TAG
    src = os.path.join(ckpt, DS_TAG)
    mine = f"mp_rank_{tp_rank:02d}"
    with tempfile.TemporaryDirectory(prefix="ttt_export_") as tmp:
        os.makedirs(os.path.join(tmp, DS_TAG))
        found = False
        for name in os.listdir(src):
            if mine in name:
                os.symlink(os.path.abspath(os.path.join(src, name)),
                           os.path.join(tmp, DS_TAG, name.replace(mine, "mp_rank_00")))
                found = True
        if not found:
            raise RuntimeError(f"{src} has no files of tensor-parallel rank {tp_rank} (*{mine}*)")
        return _zero_fp32(tmp)


def consolidated_state_dict(ckpt: str) -> dict:
    """The single-rank LM's fp32 state dict from a checkpoint directory (step_…)."""
    from ttt_lm.train.checkpoint import STATE_FILE
    with open(os.path.join(ckpt, STATE_FILE)) as f:
        state = json.load(f)
    tp = state.get("tensor_parallel", 1)  # checkpoints from before TP support are tp = 1
    if tp == 1:
        return _zero_fp32(ckpt)
    from ttt_lm.parallel.tensor_parallel import join_shards
    from ttt_lm.parallel.tp_model import split_spec
    dims = state["partition_dims"]
    slices = [_tp_rank_state_dict(ckpt, r) for r in range(tp)]
    out = {}
    for k, v in slices[0].items():
        if any(k not in s for s in slices):
            # a tied LM head is listed under its own name by some TP ranks only (DeepSpeed's
            # shared_params); its tensor is the embedding's, and export's load checks the rest
            continue
        d, stride = split_spec(dims.get(k))
        out[k] = v if d is None else join_shards([s[k] for s in slices], d, stride).contiguous()
    return out


class TokenizerSource:
    """Where an export's tokenizer comes from: ``path`` (a ``.model`` file) or, when there is none,
    ``reason``, a sentence saying why."""

    def __init__(self, path: Optional[str] = None, sha256: Optional[str] = None, reason: str = ""):
        self.path, self.sha256, self.reason = path, sha256, reason


def find_tokenizer(cfg, tokenizer: Optional[str] = None) -> TokenizerSource:
    """The tokenizer of a run: ``tokenizer`` (a ``.model`` file or a prepared data directory) if
    given, else the one in the config's ``data.path`` (with the manifest's sha256)."""
    from ttt_lm.data import DataError, load_manifest
    from ttt_lm.data.tokenizer import TokenizerError
    src = tokenizer or cfg.data.path
    if tokenizer is not None and os.path.isfile(tokenizer):
        return TokenizerSource(os.path.abspath(tokenizer))
    if tokenizer is not None and not os.path.isdir(tokenizer):
        raise TokenizerError(f"tokenizer {tokenizer} does not exist (a .model file or a prepared data directory)")
    if not src or not os.path.isdir(src):
        return TokenizerSource(reason=f"the checkpoint config's data.path {src!r} is not a directory here")
    try:
        man = load_manifest(src, check_files=False)
    except DataError as e:
        if tokenizer:
            raise
        return TokenizerSource(reason=str(e))
    return TokenizerSource(man["tokenizer_path"], man.get("tokenizer_sha256"))


def trained_tokenizer_sha256(ckpt: str) -> Optional[str]:
    """The sha256 of the tokenizer a checkpoint's run trained with, as its ``trainer_state.json``
    records it (the data manifest's ``tokenizer_sha256`` among the resume invariants); None for a
    checkpoint that records none (older ones, synthetic data)."""
    from ttt_lm.train.checkpoint import STATE_FILE
    try:
        with open(os.path.join(ckpt, STATE_FILE)) as f:
            rec = json.load(f).get("invariants", {}).get("tokenizer")
    except (OSError, ValueError, AttributeError):
        return None
    return rec if isinstance(rec, str) and len(rec) == 64 and all(c in "0123456789abcdef" for c in rec) else None


def tokenizer_problem(source: TokenizerSource, vocab_size: int, trained_sha256: Optional[str] = None) -> str:
    """Why ``source`` is not this model's tokenizer ("" when it is): a digest that differs from its
    data manifest or from the one the run trained with, or more tokens than the model's
    embedding has."""
    from ttt_lm.data.tokenizer import open_tokenizer, sha256_file
    if not os.path.isfile(source.path):
        return f"tokenizer {source.path} does not exist"
    digest = sha256_file(source.path)
    if source.sha256 is not None and digest != source.sha256:
        return f"tokenizer {source.path}: sha256 differs from its data manifest"
    if trained_sha256 is not None and digest != trained_sha256:
        return (f"tokenizer {source.path} is not the one this checkpoint was trained with (sha256 {digest[:12]}… "
                f"vs {trained_sha256[:12]}… recorded in the checkpoint)")
    from ttt_lm.data.manifest import vocab_fits
    n = open_tokenizer(source.path).vocab_size
    if not vocab_fits(vocab_size, n, allow_padding=True):
        return f"tokenizer {source.path} has {n} tokens but the model's vocab_size is {vocab_size}"
    return ""


def export(ckpt: str, out_dir: str, tokenizer: Optional[str] = "auto", fmt: str = "pt") -> str:
    """Export checkpoint ``ckpt`` into ``out_dir``. ``tokenizer``: ``"auto"`` copies the tokenizer
    of the checkpoint config's ``data.path`` when it is there and is the one the run trained with
    (else the export has none, with a note saying why); a path copies that ``.model`` /
    ``tokenizer.json`` file or prepared directory's tokenizer, and any problem with it is an
    error; None copies none. ``fmt``: ``"pt"`` (model.pt + config.yaml) or ``"hf"`` (a Hugging
    Face folder: model.safetensors + config.json, see :mod:`ttt_lm.hf`)."""
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {list(FORMATS)}, got {fmt!r}")
    from ttt_lm.data.tokenizer import TokenizerError
    from ttt_lm.model import LM
    from ttt_lm.train.checkpoint import CheckpointError, resolve
    ckpt = resolve(ckpt)
    cfg = load_config(os.path.join(ckpt, CONFIG))
    try:
        sd = consolidated_state_dict(ckpt)
    except Exception as e:  # noqa: BLE001 - DeepSpeed asserts, zip and pickle errors alike
        raise CheckpointError(f"cannot read the weights of {ckpt}: {type(e).__name__}: {e}") from e
    model = LM(cfg.model)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # a tied LM head is one tensor with the embedding; zero_to_fp32 may list it under either name
    missing = [k for k in missing if not (cfg.model.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {ckpt} does not match its config: missing {missing}, unexpected {unexpected}")
    tok_path = None
    if tokenizer is not None:
        auto = tokenizer == "auto"
        source = find_tokenizer(cfg, None if auto else tokenizer)
        problem = source.reason if source.path is None else tokenizer_problem(
            source, cfg.model.vocab_size, trained_tokenizer_sha256(ckpt))
        if problem and not auto:
            raise TokenizerError(problem)
        if problem:
            print(f"note: {out_dir} gets no {TOKENIZER}: {problem}; evaluating text or generating from this "
                  f"export will need --tokenizer (or export again with --tokenizer PATH)", file=sys.stderr)
        else:
            tok_path = source.path
    if fmt == "hf":
        from ttt_lm.hf import save_hf
        return save_hf(model, out_dir, tok_path)
    return save_export(model, cfg, out_dir, tok_path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ttt_lm.train.export", description=__doc__.splitlines()[0])
    ap.add_argument("ckpt", help="a checkpoint dir (step_…), a checkpoints/ dir or a run dir")
    ap.add_argument("out_dir")
    ap.add_argument("--tokenizer", default="auto",
                    help="a .model / tokenizer.json file or prepared data dir to copy (default: the one of "
                         "the checkpoint config's data.path, when that directory is here)")
    ap.add_argument("--format", choices=FORMATS, default="pt",
                    help="pt: model.pt + config.yaml (default); hf: a Hugging Face folder (model.safetensors + "
                         "config.json) for AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)")
    a = ap.parse_args(argv)
    from ttt_lm.data import DataError
    from ttt_lm.data.tokenizer import TokenizerError
    from ttt_lm.train.checkpoint import CheckpointError
    try:
        out = export(a.ckpt, a.out_dir, a.tokenizer, a.format)
    except (CheckpointError, DataError, TokenizerError, ValueError) as e:  # the message names the file
        print(f"error: {e}", file=sys.stderr)  # (HFError and the like name the folder)
        return 2  # refused input: the commands' one convention (README, "Exit status")
    main_files = [WEIGHTS, CONFIG] if a.format == "pt" else ["model.safetensors", "config.json"]
    files = main_files + [t for t in (TOKENIZER, HF_TOKENIZER) if os.path.isfile(os.path.join(out, t))]
    print(f"exported {a.ckpt} -> {os.path.abspath(out)} ({', '.join(files)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
