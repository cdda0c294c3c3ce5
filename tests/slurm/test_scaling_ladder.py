"""A scaling-law ladder as a Slurm job array on the local cluster: `python -m ttt_lm.scaling run
DIR --slurm` goes through slurm/submit.py sweep; each array task trains one run; `collect` then
finds every run's final loss. Two runs of a few steps keep it cheap."""
import json
import os
import re
import sys

import pytest

from ttt_lm.scaling import ladder as Lm
from ttt_lm.scaling import sweep as S

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.slurm


def test_ladder_runs_as_a_job_array(slurm_cluster, tiny_corpus, tmp_path):
    with open(os.path.join(tiny_corpus, "manifest.json")) as f:
        vocab = json.load(f)["vocab_size"]
    d = str(tmp_path / "ladder")
    runs = Lm.plan([os.path.join(ROOT, "configs", "tiny_transformer.yaml")], d, sizes=[25e3, 80e3],
                   tokens_per_param=0.01, count="non_embedding", head_dim=16, aspect=16, batch_tokens=64,
                   min_steps=4, eval_points=2,
                   overrides=[f"model.vocab_size={vocab}", f"data.path={tiny_corpus}", "data.seq_len=32",
                              "train.micro_batch_size=2", "eval.batches=1", "checkpoint.every=0",
                              "logging.progress=false", "logging.tensorboard=false"])
    assert len(runs) == 2
    r = slurm_cluster.run([sys.executable, "-m", "ttt_lm.scaling", "run", d, "--slurm", "--", "--gpus-per-node", "0",
                           "--tasks-per-node", "1", "--cpus-per-task", "1", "--time", "10"], cwd=ROOT)
    jid = r.stdout.strip()
    assert re.fullmatch(r"\d+", jid), r.stdout + r.stderr
    for i in range(2):
        info = slurm_cluster.wait_job(f"{jid}_{i}", timeout=150)
        assert info["ExitCode"] == "0:0", info
    assert all(S.finished(x) for x in runs)
    rows = S.collect_rows([d])
    final = [x for x in rows if x["final"]]
    assert sorted(x["run"] for x in final) == sorted(x.name for x in runs)
    assert os.path.exists(os.path.join(d, "slurm", f"slurm-{jid}_0.out"))
