"""One exit-status convention across the commands (README, "Exit status"): 0 done, 2 when a command
refuses its input (an argument, config, checkpoint or file it cannot use), with one line on stderr,
``error: ...``, naming it and no traceback; argparse's own usage errors are 2 as well. Each
command's main is called in this process with an input it must refuse."""
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _script_main(rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _eval(argv):
    from ttt_lm.eval.__main__ import main
    return main(argv)


def _generate(argv):
    from ttt_lm.generate import main
    return main(argv)


def _export(argv):
    from ttt_lm.train.export import main
    return main(argv)


def _convert(argv):
    from ttt_lm.convert import main
    return main(argv)


def _info(argv):
    from ttt_lm.info import main
    return main(argv)


def _train_py(argv):
    return _script_main("train.py", "train_script").cli(argv)


def _train(argv):
    from ttt_lm.train import main
    return main(argv)


def _submit(argv):
    return _script_main("slurm/submit.py", "submit_script").main(argv)


def _prepare(argv):
    from ttt_lm.data.prepare import main
    return main(argv)


def _scaling(argv):
    from ttt_lm.scaling.__main__ import main
    return main(argv)


# (command, its main, a refused input with {m} a path that does not exist, what the message says)
CASES = [
    ("python -m ttt_lm.eval", _eval, ["perplexity", "--checkpoint", "{m}"], "does not exist"),
    ("python -m ttt_lm.eval", _eval, ["long_context", "--checkpoint", "{m}", "--max-len", "64"], "does not exist"),
    ("python -m ttt_lm.generate", _generate, ["--checkpoint", "{m}", "--prompt", "x"], "does not exist"),
    ("python -m ttt_lm.train.export", _export, ["{m}", "{m}_out"], "{m}"),
    ("python -m ttt_lm.convert", _convert, ["from-hf", "{m}", "{m}_out"], "does not exist"),
    ("python -m ttt_lm.info", _info, ["{m}.yaml"], "not found"),
    ("python train.py --print-config", _train_py, ["--print-config", "{m}.yaml"], "not found"),
    ("python train.py", _train, ["{m}.yaml"], "not found"),
    ("python slurm/submit.py", _submit, ["train", "{m}.yaml", "--dry-run"], "not found"),
    ("python -m ttt_lm.scaling", _scaling, ["fit", "{m}.csv"], "{m}.csv"),
    ("python -m ttt_lm.data.prepare", _prepare, ["--input", "{m}.txt", "--output", "{m}_out"], "{m}.txt"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]} {c[2][0]}" for c in CASES])
def test_refused_input_exits_2_with_one_line(case, tmp_path, capsys):
    _, main, argv, said = case
    m = str(tmp_path / "missing")
    rc = main([a.format(m=m) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert any(ln.startswith(("error", "config error")) and said.format(m=m) in ln for ln in lines), err
    assert "Traceback" not in err, err


@pytest.mark.parametrize("main", [_eval, _generate, _export, _convert, _info, _scaling])
def test_usage_errors_are_2_too(main, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--no-such-option"])
    assert e.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_train_exits_1_on_a_checkpoint_or_data_error(monkeypatch, capsys):
    """train.py's one exception to the convention (docs/limitations.md): a checkpoint or data
    error may arise while working (a full disk at a save, a shard cut short mid-run) as well as
    at startup, and exits 1 with one line either way."""
    import ttt_lm.train.trainer as tr
    from ttt_lm.data.errors import DataError

    for exc in (tr.CheckpointError("no space left on the device for checkpoint runs/x/step_4"),
                DataError("shard data/x/train-00001.bin is cut short")):
        def fail(cfg, *a, _e=exc, **kw):
            raise _e
        monkeypatch.setattr(tr, "train", fail)
        assert tr.main([str(ROOT / "configs" / "tiny.yaml")]) == 1
        err = capsys.readouterr().err
        assert [ln for ln in err.splitlines() if ln.strip()] == [f"error: {exc}"], err
