"""The whole Hugging Face path on a real run: a parquet dataset prepared with a tokenizer.json,
train.py for 2 steps, ``export --format hf``, then transformers reads the folder (same logits as
the plain export, AutoTokenizer with the run's end-of-document token) and ``convert from-hf``
brings it back bit-identically; the generate CLI samples from the HF-tokenizer export."""
import json
import os
import subprocess
import sys

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.hf.test_hf import V, bpe
from ttt_lm.data.prepare import prepare
from ttt_lm.convert import main as convert_main
from ttt_lm.generate import main as generate_main
from ttt_lm.train.export import export, load_pretrained

# slow: trains a run with train.py in a spawned process
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args, cwd=ROOT):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("hfrun")
    words = "the quick brown fox jumps over the lazy dog while seven old kings sang".split()
    texts = [" ".join(words[(i + j) % len(words)] for j in range(60)) for i in range(30)]
    datasets.Dataset.from_dict({"text": texts}).to_parquet(str(base / "docs.parquet"))
    data = str(base / "data")
    prepare([str(base / "docs.parquet")], data, tokenizer=bpe(str(base / "tokenizer.json")), shard_tokens=2000,
            val_fraction=0.1, workers=1, progress=False)
    # the tiny preset as it stands (its vocabulary is the prepared tokenizer's); only the run is short
    r = _run(["train.py", "configs/tiny.yaml", f"data.path={data}", f"model.vocab_size={V}",
              "data.seq_len=32", "train.micro_batch_size=2", "train.max_steps=2",
              "optim.warmup_steps=1", "eval.every=0", "logging.tensorboard=false", "logging.progress=false",
              "train.device=cpu", f"train.run_dir={base / 'run'}"])
    assert r.returncode == 0, r.stdout + r.stderr
    return base


def test_export_format_hf_of_a_trained_run(run):
    export(str(run / "run"), str(run / "pt"))
    r = _run(["-m", "ttt_lm.train.export", str(run / "run"), str(run / "hf"), "--format", "hf"])
    assert r.returncode == 0, r.stderr
    assert "model.safetensors" in r.stdout and "tokenizer.json" in r.stdout
    ours = load_pretrained(str(run / "pt"))
    hf = AutoModelForCausalLM.from_pretrained(str(run / "hf")).eval()
    tok = AutoTokenizer.from_pretrained(str(run / "hf"))
    with open(run / "data" / "manifest.json") as f:
        man = json.load(f)
    assert tok.eos_token_id == man["eos_id"] == hf.config.eos_token_id
    ids = torch.tensor([tok("the lazy dog jumps over")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, ours(ids).logits)
    assert torch.equal(hf.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=None),
                       ours.generate(ids, 5, temperature=0))
    # import back: the plain export's tensors, bit for bit
    assert convert_main(["from-hf", str(run / "hf"), str(run / "back")]) == 0
    a, b = ours.state_dict(), load_pretrained(str(run / "back")).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_generate_cli_with_a_hf_tokenizer(run, capsys):
    out = run / "pt2"
    export(str(run / "run"), str(out))
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()
    capsys.readouterr()
    assert generate_main(["--checkpoint", str(out), "--prompt", "the quick", "--max-new-tokens", "6",
                          "--temperature", "0", "--device", "cpu", "--json"]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["prompt"] == "the quick" and 1 <= len(s["ids"]) <= 6
