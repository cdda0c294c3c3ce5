"""Prepare with a Hugging Face tokenizer (tokenizer.json) and Hugging Face dataset inputs
(.parquet, .arrow, save_to_disk folders). The tokenizer is a tiny byte-level BPE trained here
with ``tokenizers``, in GPT-NeoX's style (its end-of-document token <|endoftext|>); nothing is
downloaded."""
import json
import os
import shutil

import datasets
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.data.corpus import make_texts
from ttt_lm.data import iter_documents, load_manifest, load_tokenizer
from ttt_lm.data.prepare import main as prepare_main
from ttt_lm.data.prepare import prepare
from ttt_lm.data.sources import InputError, list_input_files, read_documents
from ttt_lm.data.tokenizer import HFTokenizer, TokenizerError, open_tokenizer

TEXTS = make_texts(12, seed=3)


def _bpe(path: str, special=("<|endoftext|>", "<|padding|>")) -> str:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=320, special_tokens=list(special),
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    tk.save(path)
    return path


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    return _bpe(str(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_inputs(tmp_path_factory):
    """The same 12 documents as a parquet file, an arrow file and a save_to_disk folder, the
    text under "body" (a non-default field) with another column beside it."""
    root = tmp_path_factory.mktemp("hfdata")
    ds = datasets.Dataset.from_dict({"id": list(range(len(TEXTS))), "body": TEXTS})
    ds.to_parquet(str(root / "docs.parquet"))
    ds.save_to_disk(str(root / "saved"))
    arrow = [f for f in os.listdir(root / "saved") if f.endswith(".arrow")]
    assert len(arrow) == 1
    shutil.copyfile(root / "saved" / arrow[0], root / "docs.arrow")
    return {"parquet": str(root / "docs.parquet"), "arrow": str(root / "docs.arrow"), "saved": str(root / "saved")}


def _read_back(out):
    tok = load_tokenizer(out)
    docs = {}
    for split in [s for s in ("train", "val") if load_manifest(out)["splits"][s]["documents"]]:
        for i, ids in iter_documents(out, split, with_ids=True):
            assert int(ids[-1]) == tok.eos_id and (ids[:-1] != tok.eos_id).all()
            docs[i] = tok.decode(ids[:-1].tolist())
    return [docs[i] for i in sorted(docs)]


@pytest.mark.parametrize("kind", ["parquet", "arrow", "saved"])
def test_prepare_hf_dataset_with_hf_tokenizer(kind, hf_inputs, hf_tok, tmp_path):
    """Every input kind gives the same shards: each document is the tokenizer.json's ids with
    <|endoftext|> appended, and decodes back to the row's text."""
    out = str(tmp_path / "out")
    man = prepare([hf_inputs[kind]], out, tokenizer=hf_tok, text_field="body", shard_tokens=300,
                  val_fraction=0.2, workers=1, progress=False)
    eos = Tokenizer.from_file(hf_tok).token_to_id("<|endoftext|>")
    assert man["tokenizer"] == "tokenizer.json" and man["tokenizer_type"] == "hf"
    assert man["eos_id"] == eos and man["vocab_size"] == Tokenizer.from_file(hf_tok).get_vocab_size()
    assert man["documents"] == len(TEXTS) and man["splits"]["val"]["documents"] == 3
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        assert json.load(f)["eos_token"] == "<|endoftext|>"
    assert isinstance(load_tokenizer(out), HFTokenizer)
    assert _read_back(out) == TEXTS


def test_cli_with_tokenizer_json_and_a_directory_of_datasets(hf_inputs, hf_tok, tmp_path):
    """A directory holding a save_to_disk folder and files is searched: the folder is one input
    (its .arrow file is not read twice) and parquet files are found."""
    src = tmp_path / "in"
    os.makedirs(src)
    shutil.copytree(hf_inputs["saved"], src / "a_saved")
    shutil.copyfile(hf_inputs["parquet"], src / "b.parquet")
    assert list_input_files([str(src)]) == [str(src / "a_saved"), str(src / "b.parquet")]
    out = str(tmp_path / "out")
    rc = prepare_main(["--input", str(src), "--output", out, "--tokenizer", hf_tok, "--text-field", "body",
                       "--val-fraction", "0", "--workers", "2", "--no-progress"])
    assert rc == 0
    assert _read_back(out) == TEXTS + TEXTS


def test_eos_token_of_a_hf_tokenizer(tmp_path):
    """No known end-of-document token: refused with a message naming --eos-token; --eos-token
    picks one and is recorded beside the copy; a tokenizer_config.json beside the file wins
    over the known names."""
    bare = _bpe(str(tmp_path / "bare.json"), special=("[SEP]", "[PAD]"))
    with pytest.raises(TokenizerError, match="--eos-token"):
        HFTokenizer(bare)
    with pytest.raises(TokenizerError, match="not in its vocabulary"):
        HFTokenizer(bare, eos_token="<|nope|>")
    tok = open_tokenizer(bare, eos_token="[SEP]")
    assert tok.eos_id == Tokenizer.from_file(bare).token_to_id("[SEP]")
    out = str(tmp_path / "out")
    with open(tmp_path / "docs.jsonl", "w") as f:
        for t in TEXTS:
            f.write(json.dumps({"text": t}) + "\n")
    with pytest.raises(TokenizerError, match="--eos-token"):
        prepare([str(tmp_path / "docs.jsonl")], out, tokenizer=bare, workers=1, progress=False)
    man = prepare([str(tmp_path / "docs.jsonl")], out, tokenizer=bare, eos_token="[SEP]", val_fraction=0,
                  workers=1, progress=False)
    assert man["eos_id"] == tok.eos_id and load_tokenizer(out).eos_id == tok.eos_id
    assert _read_back(out) == TEXTS
    # a tokenizer_config.json beside the file names the eos token
    d = tmp_path / "withcfg"
    os.makedirs(d)
    named = _bpe(str(d / "tokenizer.json"))
    with open(d / "tokenizer_config.json", "w") as f:
        json.dump({"eos_token": {"content": "<|padding|>"}}, f)
    assert HFTokenizer(named).eos_token == "<|padding|>"
    assert HFTokenizer(_bpe(str(tmp_path / "plain.json"))).eos_token == "<|endoftext|>"


def test_bad_hf_inputs(hf_inputs, hf_tok, tmp_path):
    with pytest.raises(InputError, match=r"no field 'text'.*'body'"):
        list(read_documents([hf_inputs["parquet"]]))
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a b"]}),
                               "test": datasets.Dataset.from_dict({"text": ["c"]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(InputError, match=r"DatasetDict with splits \['test', 'train'\]"):
        list(read_documents([str(tmp_path / "dd")]))
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match="bad.parquet: cannot be read as a Hugging Face dataset"):
        list(read_documents([str(bad)]))
    nums = tmp_path / "nums.parquet"
    datasets.Dataset.from_dict({"text": [1, 2]}).to_parquet(str(nums))
    with pytest.raises(InputError, match="is int, not a string"):
        list(read_documents([str(nums)]))
    with pytest.raises(TokenizerError, match="cannot be loaded as a Hugging Face tokenizer"):
        (tmp_path / "junk.json").write_text("{}")
        prepare([hf_inputs["parquet"]], str(tmp_path / "o"), tokenizer=str(tmp_path / "junk.json"), progress=False)
