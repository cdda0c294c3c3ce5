"""The eval CLI launched as two processes (gloo on CPU) gives one process's results.

Each run starts two real ``python -m ttt_lm.eval`` processes with the variables a launcher sets
(torchrun's RANK/WORLD_SIZE/LOCAL_RANK, or srun's SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID) and
compares rank 0's JSON with an in-process single run. The work sizes are odd (13 perplexity
batches, 3 documents, 3 passkey trials) so the ranks get unequal shares.
"""
import json
import os
import subprocess
import sys

import pytest

from ttt_lm.eval.__main__ import main
from ttt_lm.env import detect_env
from tests.distributed import free_port

pytestmark = pytest.mark.dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launch(argv, out_dir, launcher="torchrun", world=2):
    port = str(free_port())
    procs = []
    for r in range(world):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_", "MASTER_"))}
        env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONPATH=ROOT,
                   CUDA_VISIBLE_DEVICES="")
        if launcher == "torchrun":
            env.update(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r))
        else:
            env.update(SLURM_PROCID=str(r), SLURM_NTASKS=str(world), SLURM_STEP_NUM_TASKS=str(world),
                       SLURM_LOCALID=str(r))
        procs.append(subprocess.Popen([sys.executable, "-m", "ttt_lm.eval", *argv, "--out", str(out_dir),
                                       "--device", "cpu", "--no-progress"], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, o, e))
    return outs


def _run_both(argv, tmp_path, name, launcher="torchrun"):
    assert main([*argv, "--out", str(tmp_path / "one"), "--device", "cpu", "--no-progress"]) == 0
    outs = _launch(argv, tmp_path / "two", launcher)
    for rc, o, e in outs:
        assert rc == 0, e
    assert outs[0][1].strip() and not outs[1][1].strip()  # rank 0 alone prints
    one = json.loads((tmp_path / "one" / name).read_text())
    two = json.loads((tmp_path / "two" / name).read_text())
    assert one["world_size"] == 1 and two["world_size"] == 2
    return one["result"], two["result"]


def rank_from_env(environ):
    e = detect_env(environ)
    return e.rank, e.world_size, e.local_rank


def test_rank_from_env():
    assert rank_from_env({}) == (0, 1, 0)
    assert rank_from_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}) == (3, 8, 1)
    srun = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_STEP_NUM_TASKS": "6", "SLURM_LOCALID": "2"}
    assert rank_from_env(srun) == (5, 6, 2)
    # the shell of an sbatch script (no srun step) is one process whatever the allocation's size
    assert rank_from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}) == (0, 1, 0)
    # torchrun inside an allocation: its own variables win over Slurm's
    assert rank_from_env({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == (1, 2, 0)


def test_perplexity_two_processes_equal_one(attn_export, tmp_path):
    one, two = _run_both(["perplexity", "--checkpoint", attn_export, "--seq-len", "64", "--batch-size", "5"],
                         tmp_path, "perplexity.json")
    assert one["batches"] % 2 == 1  # unequal shares
    for k in ("tokens", "bytes", "batches", "seq_len", "source", "checkpoint"):
        assert two[k] == one[k], k
    # identical batches give bit-identical per-batch sums; only the order of the float64 additions
    # differs (~1e-16 relative per addition)
    for k in ("nll_sum", "loss", "perplexity", "bits_per_byte", "bytes_per_token"):
        assert two[k] == pytest.approx(one[k], rel=1e-12, abs=0), k


def test_long_context_two_processes_equal_one(attn_export, tmp_path):
    # launched as srun would: SLURM_* variables only
    one, two = _run_both(["long_context", "--checkpoint", attn_export, "--names", "attn", "--max-len", "256",
                          "--lengths", "64,256", "--chunk-len", "128", "--buckets", "8"],
                         tmp_path, "long_context.json", launcher="slurm")
    a, b = one["attn"], two["attn"]
    assert a["documents"] == b["documents"] == 3 and a["skipped"] == b["skipped"]
    assert [(x["start"], x["end"], x["tokens"]) for x in a["buckets"]] == \
        [(x["start"], x["end"], x["tokens"]) for x in b["buckets"]]
    # per-position float64 sums of per-document float32 losses, added in another order: ~1e-16
    for x, y in zip(a["buckets"], b["buckets"]):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-12, abs=0)
        # per-document rows are gathered whole from the rank that ran them: the same bands
        assert x["ci95"] is not None and y["ci95"] == pytest.approx(x["ci95"], rel=1e-12)
    for L in ("64", "256"):
        assert b["mean_loss_at_length"][L]["tokens"] == a["mean_loss_at_length"][L]["tokens"]
        assert b["mean_loss_at_length"][L]["loss"] == pytest.approx(a["mean_loss_at_length"][L]["loss"], rel=1e-12)
    assert (tmp_path / "two" / "long_context.png").read_bytes()[:4] == b"\x89PNG"


def test_passkey_two_processes_equal_one(attn_export, tmp_path):
    one, two = _run_both(["passkey", "--checkpoint", attn_export, "--lengths", "300", "--depths", "0,0.5,1",
                          "--trials", "1"], tmp_path, "passkey.json")
    assert len(one["samples"]) == 3
    assert two == one  # counts and decoded outputs: exactly equal
