"""Export a training checkpoint to a plain PyTorch state dict and its config.

    python -m ttt_lm.train.export runs/tiny/checkpoints/step_00000200 out/tiny
    python -m ttt_lm.train.export runs/tiny out/tiny          # the run's newest checkpoint

writes ``out/tiny/model.pt`` (the LM's full fp32 state dict, consolidated from the ZeRO shards with
DeepSpeed's zero_to_fp32, whatever the stage) and ``out/tiny/config.yaml``. A checkpoint of a
tensor-parallel run (``parallel.tensor_parallel`` = p > 1) holds p slices of the model, DeepSpeed's
``…mp_rank_0r…`` files of TP rank r: each is consolidated on its own, then the slices are
concatenated along the dimension the checkpoint's ``partition_dims`` records for each parameter
(replicated ones, the norms' gains, are taken from TP rank 0). The result is the single-rank LM,
which ``train.init_from`` loads whatever tensor_parallel the new run uses.
``load_pretrained("out/tiny")`` returns the LM, on CPU, in eval mode. Needs no process group.
The checkpoint is verified first (``ttt_lm.train.checkpoint.select``): from a run directory the
newest checkpoint whose files match their recorded digests is exported, and a damaged step
directory is an error naming the file.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

from ttt_lm.config import load_config, save_config

WEIGHTS = "model.pt"
CONFIG = "config.yaml"


def _zero_fp32(ckpt_dir: str) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from ttt_lm.train.checkpoint import DS_TAG
    sd = get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag=DS_TAG)
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
    dims = state["partition_dims"]
    slices = [_tp_rank_state_dict(ckpt, r) for r in range(tp)]
    out = {}
    for k, v in slices[0].items():
        if any(k not in s for s in slices):
            # a tied LM head is listed under its own name by some TP ranks only (DeepSpeed's
            # shared_params); its tensor is the embedding's, and export's load checks the rest
            continue
        d = dims.get(k)
        out[k] = v if d is None else torch.cat([s[k] for s in slices], dim=d).contiguous()
    return out


def export(ckpt: str, out_dir: str) -> str:
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
    return save_export(model, cfg, out_dir)


def save_export(model, cfg, out_dir: str) -> str:
    """Write an export directory: ``model``'s state dict (renamed into place when complete) and
    the experiment config ``cfg``."""
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, WEIGHTS + ".tmp")
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, os.path.join(out_dir, WEIGHTS))
    save_config(cfg, os.path.join(out_dir, CONFIG))
    return out_dir


def load_state_dict_into(model, out_dir: str) -> None:
    sd = torch.load(os.path.join(out_dir, WEIGHTS), map_location="cpu", weights_only=True)
    model.load_state_dict(sd)


def load_pretrained(out_dir: str, map_location="cpu"):
    """The LM saved by ``export`` in out_dir."""
    from ttt_lm.model import LM
    cfg = load_config(os.path.join(out_dir, CONFIG))
    model = LM(cfg.model)
    model.load_state_dict(torch.load(os.path.join(out_dir, WEIGHTS), map_location=map_location, weights_only=True))
    return model.eval()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ttt_lm.train.export", description=__doc__.splitlines()[0])
    ap.add_argument("ckpt", help="a checkpoint dir (step_…), a checkpoints/ dir or a run dir")
    ap.add_argument("out_dir")
    a = ap.parse_args(argv)
    from ttt_lm.train.checkpoint import CheckpointError
    try:
        out = export(a.ckpt, a.out_dir)
    except CheckpointError as e:  # missing, incomplete or damaged: the message names the file
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"exported {a.ckpt} -> {os.path.abspath(out)} ({WEIGHTS}, {CONFIG})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
