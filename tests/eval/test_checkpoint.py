import os

import pytest
import torch
import yaml

from tests.eval.conftest import export_model, tiny_model
from ttt_lm.eval import EvalError, load_checkpoint, load_model


def test_export_round_trip_gives_the_same_logits(tmp_path):
    from ttt_lm.model.registry import builtin_kinds
    kinds = builtin_kinds()   # one layer of every built-in kind
    m = tiny_model(kinds, n_layers=len(kinds))
    d = export_model(m, str(tmp_path / "e"), data_path="some/data")
    ck = load_checkpoint(d)
    assert ck.data_path == "some/data" and ck.name == "e"
    ids = torch.randint(0, 300, (2, 11))
    with torch.no_grad():
        assert torch.equal(ck.model(ids).logits, m(ids).logits)
    assert not ck.model.training


def test_bare_model_config_and_wrapped_state_dict(tmp_path):
    m = tiny_model(("attention",))
    os.makedirs(tmp_path / "b")
    torch.save({"model": {"module." + k: v for k, v in m.state_dict().items()}}, tmp_path / "b" / "model.pt")
    fields = {"vocab_size": 300, "d_model": 32, "n_layers": 2, "n_heads": 2, "layer_pattern": ["attention"],
              "max_seq_len": 256}
    (tmp_path / "b" / "config.yaml").write_text(yaml.safe_dump(fields))
    got = load_model(str(tmp_path / "b"))
    ids = torch.randint(0, 300, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(got(ids).logits, m(ids).logits, atol=0, rtol=0)


def test_weights_of_another_model_are_refused_with_the_differences(tmp_path):
    d = export_model(tiny_model(("attention",)), str(tmp_path / "e"))
    other = tiny_model(("attention",), n_layers=4)  # two more layers, same width
    torch.save(other.state_dict(), os.path.join(d, "model.pt"))
    with pytest.raises(EvalError, match=r"do not belong.*unexpected layers\.2\."):
        load_model(d)
    wide = tiny_model(("attention",), vocab_size=320)
    torch.save(wide.state_dict(), os.path.join(d, "model.pt"))
    with pytest.raises(EvalError, match=r"shape mismatch embed\.weight: checkpoint \(320, 32\) vs model \(300, 32\)"):
        load_model(d)


def test_missing_pieces_are_named(tmp_path):
    with pytest.raises(EvalError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(EvalError, match="not an export directory"):
        load_model(str(tmp_path / "empty"))
    d = export_model(tiny_model(), str(tmp_path / "e"))
    with open(os.path.join(d, "model.pt"), "wb") as f:
        f.write(b"not a checkpoint")
    with pytest.raises(EvalError, match="cannot be read"):
        load_model(d)


def test_the_exporters_reader_and_ours_agree_on_the_format(tmp_path):
    from ttt_lm.train.export import load_pretrained
    m = tiny_model(("attention",))
    d = export_model(m, str(tmp_path / "e"))
    ids = torch.randint(0, 300, (1, 9))
    with torch.no_grad():
        assert torch.equal(load_pretrained(d)(ids).logits, load_model(d)(ids).logits)
