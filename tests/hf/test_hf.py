"""Hugging Face interop: a ttt-lm LM saved as a transformers folder gives the same logits and
the same greedy tokens there (AutoModelForCausalLM, registered or with trust_remote_code), uses
each mixer's decode state in generate, and converts back bit-identically. A stack with every
layer kind (each has a decode form) in float32: the HF model runs our LM's own code on the same
weights, so logits are compared for exact equality."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.model.mixer_checks import short_sections
from ttt_lm.config import ExperimentConfig
from ttt_lm.convert import ConversionError
from ttt_lm.convert import main as convert_main
from ttt_lm.data.tokenizer import open_tokenizer
from ttt_lm.eval.checkpoint import load_checkpoint
from ttt_lm.hf import HFError, TTTLMForCausalLM, hf_config, load_hf, save_hf
from ttt_lm.hf.modeling_ttt_lm import CACHE_NAME
from ttt_lm.model import LM, ModelConfig
from ttt_lm.model.lm import mask_vocab
from ttt_lm.model.registry import builtin_kinds
from ttt_lm.train.export import load_pretrained, save_export

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
V = 320


def tiny_cfg(pattern=None, **kw) -> ModelConfig:
    """The model of ``pattern`` (default: one layer of every built-in kind) with every section at
    its tiny sizes for n = 4 (``short_sections``: chunks and mini-batches of 4, windows of 5)."""
    pattern = builtin_kinds() if pattern is None else pattern
    cfg = ModelConfig(vocab_size=V, d_model=32, n_heads=2, n_layers=len(pattern), layer_pattern=list(pattern),
                      max_seq_len=64, **kw)
    return short_sections(cfg, 4)


def tiny_lm(**kw) -> LM:
    torch.manual_seed(0)
    return LM(tiny_cfg(**kw)).eval()


def bpe(path: str) -> str:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20,
                           trainers.BpeTrainer(vocab_size=V, special_tokens=["<|endoftext|>", "<|padding|>"],
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                               show_progress=False))
    tk.save(path)
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(our LM, its HF folder with a tokenizer.json)."""
    d = tmp_path_factory.mktemp("hf")
    lm = tiny_lm()
    out = save_hf(lm, str(d / "model"), tokenizer=bpe(str(d / "tokenizer.json")))
    return lm, out


def test_folder_layout(exported):
    _, out = exported
    files = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "generation_config.json", "configuration_ttt_lm.py",
            "modeling_ttt_lm.py", "tokenizer.json", "tokenizer_config.json"} <= files
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "ttt_lm" and cfg["auto_map"] == {
        "AutoConfig": "configuration_ttt_lm.TTTLMConfig", "AutoModelForCausalLM": "modeling_ttt_lm.TTTLMForCausalLM"}
    assert cfg["ttt_lm"]["layer_pattern"] == list(builtin_kinds()) and cfg["vocab_size"] == V
    assert cfg["eos_token_id"] == 0  # <|endoftext|>, the tokenizer's first special token
    assert "model.lm_head.weight" not in load_file(os.path.join(out, "model.safetensors"))  # tied


def test_same_logits_and_greedy_generate_as_our_lm(exported):
    """AutoModelForCausalLM (the classes registered by importing ttt_lm.hf): the logits of a
    full forward are bit-identical to the LM's; greedy generate gives the tokens of
    LM.generate, its per-step scores equal LM.step's logits, the prompt is read in one pass
    and every later token is one decode step (LM.step with every layer's state), and without
    the cache (a full forward per token) the tokens are the same."""
    lm, out = exported
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(hf, TTTLMForCausalLM) and hf.dtype == torch.float32
    # the tokenizer has fewer ids than the model's vocabulary: the rest are suppressed in generate
    n_tok = open_tokenizer(os.path.join(out, "tokenizer.json")).vocab_size
    assert n_tok < V and hf.generation_config.suppress_tokens == list(range(n_tok, V))
    ids = torch.randint(1, n_tok, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, lm(ids).logits)
        ours = lm.generate(ids, 10, temperature=0, vocab_size=n_tok)
    steps = []
    real_step = hf.model.step
    hf.model.step = lambda *a, **k: steps.append(1) or real_step(*a, **k)
    gen = hf.generate(ids, max_new_tokens=10, do_sample=False, output_scores=True, return_dict_in_generate=True,
                      eos_token_id=None, pad_token_id=None)
    hf.model.step = real_step
    assert torch.equal(gen.sequences, ours)
    assert len(steps) == 9  # one forward for the prompt and the first token, then one step per token
    with torch.no_grad():
        out_full = lm(ids, output_states=True)
        states, want = out_full.states, [out_full.logits[:, -1]]
        for t in range(9):
            lg, states = lm.step(ours[:, 13 + t], states)
            want.append(lg)
    for got, w in zip(gen.scores, want):
        torch.testing.assert_close(got, mask_vocab(w, n_tok), rtol=0, atol=0)
    no_cache = hf.generate(ids, max_new_tokens=10, do_sample=False, use_cache=False, eos_token_id=None,
                           pad_token_id=None)
    assert torch.equal(no_cache, ours)


def test_cache_continuation_labels_and_bf16(exported, tmp_path):
    """A forward that continues a returned cache with several tokens gives the full pass's
    logits (float32; the chunked forms split the sequence elsewhere, so rounding-level 1e-5);
    labels are shifted inside as in transformers; a bfloat16 model round-trips in bfloat16."""
    lm, out = exported
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(1, V, (2, 14), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = lm(ids).logits
        first = hf(ids[:, :9], use_cache=True)
        # the cache under the name the installed transformers uses, and under its older name
        assert getattr(first, CACHE_NAME) is first.past_key_values is not None
        for name in ("cache", "past_key_values"):
            rest = hf(ids[:, 9:], use_cache=True, **{name: getattr(first, CACHE_NAME)})
            assert getattr(rest, CACHE_NAME).get_seq_length() == 14 and rest.past_key_values.get_seq_length() == 14
            torch.testing.assert_close(rest.logits, full[:, 9:], atol=1e-5, rtol=0)
        aligned = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
        # the same mean over the same 26 tokens, reduced over [26] rows here and over [28] rows with
        # two ignored in the LM: float32 summation order only, ~1e-7 relative
        torch.testing.assert_close(hf(ids, labels=ids).loss, lm(ids, labels=aligned).loss, rtol=1e-6, atol=0)
    bf = tiny_lm().to(torch.bfloat16)
    back = load_hf(save_hf(bf, str(tmp_path / "bf16")))
    assert back.embed.weight.dtype == torch.bfloat16
    a, b = bf.state_dict(), back.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sampling_and_eos(exported):
    """Sampling runs on the decode state too, and generation stops at the config's eos id."""
    lm, out = exported
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    n_tok = V - len(hf.generation_config.suppress_tokens)
    ids = torch.randint(1, n_tok, (1, 6), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    a = hf.generate(ids, max_new_tokens=8, do_sample=True, top_k=20)
    torch.manual_seed(0)
    b = hf.generate(ids, max_new_tokens=8, do_sample=True, top_k=20)
    assert torch.equal(a, b) and a.shape[1] <= 14
    assert hf.generation_config.eos_token_id == 0  # the tokenizer's <|endoftext|>
    assert a[:, 6:].max() < n_tok  # no padding id is drawn
    first = lm.generate(ids, 1, temperature=0, vocab_size=n_tok)[0, -1].item()
    hf.generation_config.eos_token_id = first  # the greedy first token ends the document
    g = hf.generate(ids, max_new_tokens=8, do_sample=False)
    assert g[0, 6:].tolist() == [first]


def test_beam_search_reorders_the_states(exported):
    """Beam search (transformers reorders the cache between beams through
    ``TTTLMCache.reorder_cache``): each returned beam's score is its continuation's log-probability
    under a fresh forward pass of our LM, which a wrongly reordered state would not give."""
    lm, out = exported
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(1, V, (2, 5), generator=torch.Generator().manual_seed(3))
    g = hf.generate(ids, num_beams=3, num_return_sequences=3, max_new_tokens=5, do_sample=False,
                    length_penalty=0.0, early_stopping=True, return_dict_in_generate=True, output_scores=True)
    assert g.sequences.shape == (6, 10)
    with torch.no_grad():
        logp = torch.log_softmax(lm(g.sequences[:, :-1]).logits.double(), -1)
    cont = logp[:, 4:].gather(-1, g.sequences[:, 5:, None])[..., 0].sum(-1)
    # float32 logits summed over 5 tokens: agreement to 1e-4 (a wrong beam's state is off by O(1))
    torch.testing.assert_close(g.sequences_scores.double(), cont, atol=1e-4, rtol=0)
    assert len({tuple(r) for r in g.sequences[:3].tolist()}) == 3   # three distinct beams


def test_refusals(exported, tmp_path):
    lm, out = exported
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(1, V, (2, 5))
    with pytest.raises(ValueError, match="no padding in a forward call"):
        hf(ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1] * 5]))
    with pytest.raises(ValueError, match="left padding only"):
        hf.generate(ids, attention_mask=torch.tensor([[1, 1, 1, 1, 0], [1] * 5]), max_new_tokens=2)
    with pytest.raises(ValueError, match="all zeros"):
        hf.generate(ids, attention_mask=torch.tensor([[0] * 5, [1] * 5]), max_new_tokens=2)
    with pytest.raises(ValueError, match="return_dict_in_generate is not supported"):
        hf.generate(ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1] * 5]), max_new_tokens=2,
                    return_dict_in_generate=True)
    with pytest.raises(ValueError, match=r"the cache \(cache= or past_key_values=\) must be the TTTLMCache"):
        hf(ids, past_key_values=object())
    with pytest.raises(ValueError, match=r"the cache \(cache= or past_key_values=\) must be the TTTLMCache"):
        hf(ids, cache=object())
    c = hf(ids, use_cache=True).past_key_values
    with pytest.raises(ValueError, match="two caches given"):
        hf(ids, cache=c, past_key_values=hf(ids, use_cache=True).past_key_values)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(HFError, match="not a ttt-lm Hugging Face export"):
        save_hf(lm, str(foreign))
    assert (foreign / "notes.txt").read_text() == "mine"
    # exported again without a tokenizer: the earlier export's tokenizer does not stay behind
    again = tmp_path / "again"
    save_hf(lm, str(again), tokenizer=os.path.join(out, "tokenizer.json"))
    (again / "README.md").write_text("my notes")
    save_hf(lm, str(again))
    assert not (again / "tokenizer.json").exists() and not (again / "tokenizer_config.json").exists()
    assert (again / "README.md").read_text() == "my notes" and (again / "model.safetensors").exists()
    # a folder whose tensors do not match its config is refused, naming the tensor
    broken = tmp_path / "broken"
    save_hf(lm, str(broken))
    sd = load_file(str(broken / "model.safetensors"))
    del sd["model.norm.weight"]
    save_file(sd, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFError, match="model.norm.weight"):
        load_hf(str(broken))
    with open(broken / "config.json") as f:
        raw = json.load(f)
    raw["model_type"] = "llama"
    with open(broken / "config.json", "w") as f:
        json.dump(raw, f)
    with pytest.raises(HFError, match="model_type is 'llama'"):
        load_hf(str(broken))


@pytest.mark.parametrize("tie", [True, False])
def test_round_trip_ours_hf_ours_is_bit_identical(tie, tmp_path, capsys):
    """export dir → to-hf → from-hf → export dir: every tensor equal bit for bit, the config
    and the tokenizer carried; the result is what evals and train.init_from read."""
    lm = tiny_lm(tie_embeddings=tie)
    src = str(tmp_path / "ours")
    exp = ExperimentConfig()
    exp.model = lm.cfg
    tok = bpe(str(tmp_path / "tokenizer.json"))
    save_export(lm, exp, src, tok)
    assert convert_main(["to-hf", src, str(tmp_path / "hf")]) == 0
    assert convert_main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back = load_pretrained(str(tmp_path / "back"))
    a, b = lm.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert back.cfg == lm.cfg
    assert (back.lm_head.weight is back.embed.weight) == tie
    ck = load_checkpoint(str(tmp_path / "back"))
    assert ck.tokenizer_path.endswith("tokenizer.json")
    with open(tok, "rb") as f1, open(ck.tokenizer_path, "rb") as f2:
        assert f1.read() == f2.read()
    assert convert_main(["from-hf", str(tmp_path / "ours"), str(tmp_path / "x")]) == 2
    assert "config.json" in capsys.readouterr().err
    with pytest.raises(ConversionError, match="not an export directory"):
        from ttt_lm.convert import to_hf
        to_hf(str(tmp_path / "hf"), str(tmp_path / "y"))


REMOTE = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, ids_file = sys.argv[1], sys.argv[2]
assert "ttt_lm.hf" not in sys.modules
m = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
ids = torch.load(ids_file)
with torch.no_grad():
    logits = m(ids).logits
gen = m.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=None)
torch.save({"logits": logits, "gen": gen}, ids_file + ".out")
print(json.dumps({"module": type(m).__module__, "transformers": __import__("transformers").__version__,
                  "hf_imported": "ttt_lm.hf" in sys.modules,
                  "eos": tok.eos_token, "ids": tok("the quick fox")["input_ids"]}))
"""


@pytest.mark.slow
def test_trust_remote_code_from_the_folder_alone(exported, tmp_path):
    """A fresh process that never imports ttt_lm.hf loads the folder with trust_remote_code=True
    (the copied modeling files, which import ttt_lm) and AutoTokenizer: same logits, same
    greedy tokens, the tokenizer's eos. No network: HF_HUB_OFFLINE, a private HF_HOME."""
    lm, out = exported
    n_tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json")).get_vocab_size()
    ids = torch.randint(1, n_tok, (2, 9), generator=torch.Generator().manual_seed(3))   # the tokenizer's ids
    torch.save(ids, str(tmp_path / "ids.pt"))
    path = os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf_home"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", REMOTE, out, str(tmp_path / "ids.pt")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["module"].startswith("transformers_modules") and info["module"].endswith("modeling_ttt_lm")
    assert info["eos"] == "<|endoftext|>"
    assert info["transformers"] == __import__("transformers").__version__  # the version this process tests
    assert info["ids"] == Tokenizer.from_file(os.path.join(out, "tokenizer.json")).encode("the quick fox").ids
    got = torch.load(str(tmp_path / "ids.pt.out"))
    with torch.no_grad():
        assert torch.equal(got["logits"], lm(ids).logits)
        # the folder's generation_config suppresses the padding ids beyond the tokenizer's vocabulary
        assert torch.equal(got["gen"], lm.generate(ids, 6, temperature=0, vocab_size=n_tok))


def test_evals_read_the_hf_folder(exported):
    """load_checkpoint (what every eval and the generate CLI read) takes the folder as it is, and
    its LM is bit-identical to the one saved, input after input. The inputs come from their own
    generator, not from the global one whose state depends on the tests run before. Without
    load_hf's copy of the weights out of the file's memory map (8-byte aligned: MKL rounds TTT's
    η einsum by alignment), seeds 6, 8 and 11 here gave logits ~3e-8 off."""
    lm, out = exported
    ck = load_checkpoint(out)
    with torch.no_grad():
        for seed in range(12):
            ids = torch.randint(1, V, (1, 7), generator=torch.Generator().manual_seed(seed))
            assert torch.equal(ck.model(ids).logits, lm(ids).logits), seed
    assert ck.tokenizer_path == os.path.join(out, "tokenizer.json")


@pytest.mark.parametrize("cut", ["half", "header"])
def test_a_truncated_safetensors_file_is_named(exported, tmp_path, capsys, cut):
    """A model.safetensors cut short (an interrupted copy) is refused naming the file, by load_hf and
    by what reads it through load_checkpoint: generate and the evals (exit 2, one line, no
    traceback), as a truncated model.pt is."""
    import shutil

    from ttt_lm.eval.__main__ import main as eval_main
    from ttt_lm.generate import main as generate_main
    _, out = exported
    d = tmp_path / "cut"
    shutil.copytree(out, d)
    f = d / "model.safetensors"
    n = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(n // 2 if cut == "half" else 4)
    with pytest.raises(HFError, match=f"{f} is not a readable safetensors file"):
        load_hf(str(d))
    assert generate_main(["--checkpoint", str(d), "--prompt", "the", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{f} is not a readable safetensors file" in err and "Traceback" not in err, err
    assert eval_main(["perplexity", "--checkpoint", str(d), "--text", str(f), "--out", str(tmp_path),
                      "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{f} is not a readable safetensors file" in err and "Traceback" not in err, err


def test_autotokenizer_reads_the_folder(exported):
    _, out = exported
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    assert tok.decode(tok("the lazy dog")["input_ids"]) == "the lazy dog"


def test_autotokenizer_reads_an_exported_sentencepiece_model(tmp_path):
    """A folder exported with the project's SentencePiece tokenizer holds its tokenizer.model as it
    is; transformers' AutoTokenizer reads it (converted to a fast tokenizer) and encodes and decodes
    as our tokenizer does: byte fallback, no dummy prefix, spaces and newlines kept."""
    from tests.data.corpus import make_texts
    from ttt_lm.data.tokenizer import train_tokenizer
    ours = train_tokenizer(make_texts(60), str(tmp_path / "sp"), vocab_size=V)
    sp = str(tmp_path / "sp.model")
    out = save_hf(tiny_lm(), str(tmp_path / "model"), tokenizer=sp)
    assert os.path.isfile(os.path.join(out, "tokenizer.model"))
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert tok.eos_token_id == ours.eos_id and len(tok) == ours.vocab_size
    for s in ["the lazy dog", " a leading space", "two\n\nlines  and  gaps ", "héllo 日本 ☃", "ROMEO:"]:
        ids = ours.encode(s)
        assert tok(s, add_special_tokens=False)["input_ids"] == ids, s
        assert tok.decode(ids) == s == ours.decode(ids)


#: each built-in kind alone, then the stack of every kind
PADDED_PATTERNS = [(k,) for k in builtin_kinds()] + [builtin_kinds()]


def _context_model(pattern) -> TTTLMForCausalLM:
    """A random model whose greedy tokens depend on the context (at the default init a tiny tied
    model mostly repeats its last token): untied, init_std 0.2."""
    torch.manual_seed(0)
    return TTTLMForCausalLM(hf_config(tiny_cfg(pattern, tie_embeddings=False, init_std=0.2))).eval()


def _padded_batch(lengths, pad):
    """Prompts of the given lengths, left-padded with ``pad`` to the longest: (ids, mask, prompts)."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, V, (n,), generator=g) for n in lengths]
    T = max(lengths)
    ids = torch.stack([torch.cat([torch.full((T - len(p),), pad), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(T - len(p), dtype=torch.long), torch.ones(len(p), dtype=torch.long)])
                        for p in prompts])
    return ids, mask, prompts


@pytest.mark.parametrize("pattern", PADDED_PATTERNS, ids=lambda p: p[0] if len(p) == 1 else "every_kind")
def test_left_padded_batch_generates_each_row_as_alone(pattern):
    """Greedy generate on a left-padded batch gives every row the tokens it gets alone, for every
    mixer kind and a hybrid, laid out as transformers lays out a padded batch; reading the
    padding as tokens would change them."""
    hf = _context_model(pattern)
    ids, mask, prompts = _padded_batch([7, 3, 5], pad=1)
    batched = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None,
                          pad_token_id=1)
    assert batched.shape == (3, 7 + 6)
    assert torch.equal(batched[:, :7], ids)  # the padded prompts as given
    for i, p in enumerate(prompts):
        alone = hf.generate(p[None], max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=1)
        assert torch.equal(batched[i, 7:], alone[0, len(p):]), i
        with torch.no_grad():  # and our LM's own generate, which never sees padding
            assert torch.equal(alone, hf.model.generate(p[None], 6, temperature=0))
    unmasked = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                           eos_token_id=None, pad_token_id=1)
    assert not torch.equal(unmasked[1:, 7:], batched[1:, 7:])  # the padded rows differ when padding is read


def test_left_padded_batch_stops_rows_and_counts_max_length_like_transformers():
    """A row that meets the end-of-document id stops and is filled with pad_token_id while the
    others go on; max_length counts the padded prompt (transformers' rule); beams per row."""
    hf = _context_model(PADDED_PATTERNS[-1])
    ids, mask, prompts = _padded_batch([6, 2, 4], pad=1)
    free = [hf.generate(p[None], max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=1)[0, len(p):]
            for p in prompts]
    eos = int(free[1][1])  # row 1 stops at its second new token
    stops = [next((j + 1 for j, t in enumerate(f.tolist()) if t == eos), 6) for f in free]
    assert stops[1] <= 2 and max(stops) > stops[1]  # the others go on past it
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=1)
    assert out.shape == (3, 6 + max(stops))
    for i in range(3):
        want = torch.cat([free[i][:stops[i]], torch.full((max(stops) - stops[i],), 1)])
        assert torch.equal(out[i, 6:], want), i
    by_length = hf.generate(ids, attention_mask=mask, max_length=9, do_sample=False, eos_token_id=None,
                            pad_token_id=1)
    assert by_length.shape == (3, 9) and all(torch.equal(by_length[i, 6:], free[i][:3]) for i in range(3))
    beams = hf.generate(ids, attention_mask=mask, max_new_tokens=3, num_beams=2, num_return_sequences=2,
                        do_sample=False, eos_token_id=None, pad_token_id=1)
    assert beams.shape == (6, 9)
    for i, p in enumerate(prompts):
        alone = hf.generate(p[None], max_new_tokens=3, num_beams=2, num_return_sequences=2, do_sample=False,
                            eos_token_id=None, pad_token_id=1)
        assert torch.equal(beams[2 * i:2 * i + 2, 6:], alone[:, len(p):]) and torch.equal(beams[2 * i, :6], ids[i])


def test_from_pretrained_gives_each_tensor_memory_of_its_own(exported):
    """A folder's tensors are views into the safetensors memory map, 8-byte aligned, where MKL's
    products round differently (``TTTLMForCausalLM.from_pretrained``): loaded, each parameter and
    buffer owns its storage at the allocator's alignment, and tied weights stay one Parameter."""
    _, out = exported
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    for name, t in list(hf.named_parameters()) + list(hf.named_buffers()):
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name
        assert t.data_ptr() % 16 == 0, (name, t.data_ptr() % 64)
    assert hf.model.lm_head.weight is hf.model.embed.weight
