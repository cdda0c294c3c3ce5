"""python -m ttt_lm.eval <task> --checkpoint <export or run dir> [options]

Tasks: perplexity, long_context, passkey, synthetic, lm_eval. Each writes ``<out>/<task>.json``
(and a PNG where a picture helps) and prints a one-line summary. ``passkey_train`` fine-tunes a
checkpoint on passkey practice prompts (loss on the answer only) and writes an export directory
that ``passkey`` reads. ``synthetic_report`` trains nothing: it merges the JSON of several
``synthetic`` runs (one per mixer, or per lr) into one table and plot.

perplexity, long_context and passkey also run as several processes (``torchrun --nproc_per_node N
-m ttt_lm.eval ...`` or srun): each rank scores its share, the sums meet by all-reduce, and rank 0
alone writes and prints.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import List, Optional, Sequence

import torch

from ttt_lm.env import detect_env
from ttt_lm.eval.common import (SINGLE, EvalError, dtype_of, init_distributed, token_byte_lengths,
                                write_json)

#: tasks that split their work over the processes of a torchrun/srun launch
DISTRIBUTED_TASKS = ("perplexity", "long_context", "passkey")


def _ints(s: str) -> List[int]:
    return [int(float(x)) for x in s.split(",") if x.strip()]


def _floats(s: str) -> List[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except Exception:  # noqa: BLE001 - no git is fine
        return None


def _meta(args, device) -> dict:
    d = {k: v for k, v in vars(args).items() if k not in ("func", "dist", "dev", "written")}
    return {"args": d, "device": str(device), "world_size": args.dist.world_size, "torch": torch.__version__,
            "commit": _commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def _out(args, name: str) -> str:
    """``<out>/<name>``, recorded: ``main`` prints the ones that were written when the task ends."""
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, name)
    args.written.append(path)
    return path


def _say_written(args) -> None:
    """One line naming every file (or folder) the task wrote, on rank 0."""
    seen = [p for i, p in enumerate(args.written) if p not in args.written[:i] and os.path.exists(p)]
    if seen and args.dist.is_main:
        print("wrote " + ", ".join(seen), flush=True)


def _tokenizer(path: Optional[str], ck, what: str):
    from ttt_lm.data import load_tokenizer
    from ttt_lm.eval.checkpoint import missing_tokenizer
    p = path or ck.tokenizer_path
    if p is None:
        raise EvalError(f"{what} needs a tokenizer: {missing_tokenizer(ck)}")
    return load_tokenizer(p)


def _load(args, path: str):
    from ttt_lm.eval.checkpoint import load_checkpoint
    return load_checkpoint(path, device=args.dev, dtype=dtype_of(args.dtype))


def _progress(args) -> bool:
    return not args.no_progress and args.dist.is_main


def _say_padding(args, model, tokenizer_vocab: int, source: str) -> None:
    """Rank 0 says once that the model's vocabulary is padded beyond its data's tokenizer."""
    from ttt_lm.eval.common import vocab_padding_note
    note = vocab_padding_note(model.cfg.vocab_size, tokenizer_vocab, source)
    if note and args.dist.is_main:
        print(note, file=sys.stderr, flush=True)


def _data_path(args, ck) -> str:
    p = args.data or ck.data_path
    if not p:
        raise EvalError("no data: pass --data <prepared dir> (the checkpoint's config names none)")
    return p


# ---- tasks ---------------------------------------------------------------------------------------

def cmd_perplexity(args) -> dict:
    from ttt_lm.data import DataConfig, build_val_loader, check_vocab, iter_documents, load_manifest
    from ttt_lm.eval.perplexity import evaluate_perplexity, text_batches
    ck = _load(args, args.checkpoint)
    model = ck.model
    seq_len, window_from = perplexity_window(args.seq_len, ck.train_len, model.cfg.max_seq_len)
    if args.text:
        tok = _tokenizer(args.tokenizer, ck, "--text")
        from ttt_lm.eval.common import check_vocab as check_tok_vocab
        check_tok_vocab(model, tok.vocab_size, f"the tokenizer {tok.path}", allow_padding=True)
        _say_padding(args, model, tok.vocab_size, f"the tokenizer {tok.path}")
        with open(args.text, encoding="utf-8") as f:
            ids = torch.tensor(tok.encode(f.read()), dtype=torch.long)
        batches, total, source = text_batches(ids, seq_len, args.batch_size), None, args.text
    else:
        path = _data_path(args, ck)
        man = load_manifest(path)
        check_vocab(man, model.cfg.vocab_size, allow_padding=True)
        _say_padding(args, model, int(man["vocab_size"]), f"the data in {path}")
        from ttt_lm.data import load_tokenizer
        tok = load_tokenizer(path)
        if args.split == "val":
            loader = build_val_loader(DataConfig(path=path, seq_len=seq_len, shuffle=False), args.batch_size)
            batches, total = loader, len(loader)
        else:
            docs = list(iter_documents(path, args.split))
            ids = torch.cat(docs) if docs else torch.zeros(0, dtype=torch.long)
            batches, total = text_batches(ids, seq_len, args.batch_size), None
        source = f"{path}:{args.split}"
    res = evaluate_perplexity(model, batches, token_byte_lengths(tok, model.cfg.vocab_size), args.max_batches,
                              show_progress=_progress(args), total=total, dist=args.dist)
    res.update(source=source, seq_len=seq_len, seq_len_from=window_from, checkpoint=ck.path)
    out = dict(task="perplexity", result=res, **_meta(args, model.embed.weight.device))
    if not args.dist.is_main:
        return out
    write_json(_out(args, "perplexity.json"), out)
    print(f"perplexity {ck.name} on {source}: loss {res['loss']:.4f}  ppl {res['perplexity']:.3f}  "
          f"bpb {res.get('bits_per_byte', float('nan')):.4f}  over {res['tokens']:,} tokens in windows of "
          f"{seq_len} ({window_from})")
    return out


def perplexity_window(given: Optional[int], train_len: Optional[int], max_seq_len: int):
    """The window ``eval perplexity`` scores in, and where it comes from: ``--seq-len`` when given,
    else the checkpoint's training context (its config's data.seq_len), else (a checkpoint that does
    not record it, e.g. a Hugging Face export) min(model.max_seq_len, 2048)."""
    if given is not None:
        if given < 2:
            raise EvalError(f"--seq-len must be >= 2 (a window holds inputs and their next tokens), got {given}")
        return given, "--seq-len"
    if train_len:
        return int(train_len), "the training context, data.seq_len"
    return min(max_seq_len, 2048), "min(model.max_seq_len, 2048): the checkpoint records no data.seq_len"


def cmd_long_context(args) -> dict:
    from ttt_lm.data import check_vocab, iter_documents, load_manifest
    from ttt_lm.eval.long_context import (loss_by_position, paired_difference, plot_loss_by_position, summarize,
                                          windows)
    curves, names = {}, list(args.names.split(",")) if args.names else []
    train_lens, paired, ref = {}, {}, None
    for i, path in enumerate(args.checkpoint):
        ck = _load(args, path)
        name = names[i] if i < len(names) else ck.name
        data = _data_path(args, ck)
        man = load_manifest(data)
        check_vocab(man, ck.model.cfg.vocab_size, allow_padding=True)
        _say_padding(args, ck.model, int(man["vocab_size"]), f"the data in {data}")
        docs = iter_documents(data, args.split)
        if args.windows:
            docs = windows(docs, args.max_len + 1)
        stats = loss_by_position(ck.model, docs, args.max_len, args.chunk_len,
                                 args.min_len, args.max_docs, args.batch_size, _progress(args), dist=args.dist)
        summ = summarize(stats, args.lengths or [args.max_len], args.buckets)
        train_lens[name] = args.train_len or ck.train_len
        summ.update(checkpoint=ck.path, data=f"{data}:{args.split}", windows=bool(args.windows),
                    train_len=train_lens[name])
        curves[name] = summ
        del ck
        at = summ["mean_loss_at_length"]
        what = "window" if args.windows else "document"
        if args.dist.is_main:
            print(f"long_context {name}: mean loss over the first L tokens of each {what}: "
                  + "  ".join(f"L={k}: {v['loss']:.4f}" for k, v in at.items())
                  + f"  ({summ['documents']} {what}s)")
        if ref is None:
            ref = (name, stats)
            continue
        try:
            pd = paired_difference(ref[1], stats, args.lengths or [args.max_len])
        except EvalError as e:
            paired[name] = {"reference": ref[0], "skipped": str(e)}
            if args.dist.is_main:
                print(f"long_context {name} - {ref[0]}: no paired comparison: {e}")
            continue
        paired[name] = {"reference": ref[0], **pd}
        if args.dist.is_main:
            def fmt(r):
                ci = "" if r["ci95"] is None else f" ± {r['ci95']:.4f}"
                return f"{r['diff']:+.4f}{ci}"
            line = "  ".join(f"[{r['start']}, {r['end']}]: {fmt(r)}" for r in pd["ranges"])
            if "change" in pd:
                c = pd["change"]
                line += f"  change [{c['from'][0]}, {c['from'][1]}] -> [{c['to'][0]}, {c['to'][1]}]: {fmt(c)}"
            print(f"long_context {name} - {ref[0]}, paired over {what}s, by position (1-based; 95% interval): {line}")
    if not args.dist.is_main:
        return dict(task="long_context", result=curves)
    png = _out(args, "long_context.png")
    unit = f"windows of {args.max_len} tokens" if args.windows else f"first {args.max_len} tokens of each document"
    plot_loss_by_position(curves, png, f"loss by token position ({args.split} split, {unit})", train_lens)
    out = dict(task="long_context", result=curves, plot=png, **_meta(args, args.dev))
    if paired:
        out["paired"] = paired
    write_json(_out(args, "long_context.json"), out)
    return out


def cmd_passkey(args) -> dict:
    from ttt_lm.eval.passkey import passkey_grid, plot_heatmap
    ck = _load(args, args.checkpoint)
    tok = _tokenizer(args.tokenizer, ck, "passkey")
    _say_padding(args, ck.model, tok.vocab_size, f"the tokenizer {tok.path}")
    res = passkey_grid(ck.model, tok, args.lengths, args.depths, args.trials, args.seed, args.chunk_len,
                       show_progress=_progress(args), dist=args.dist)
    if not args.dist.is_main:
        return dict(task="passkey", result=res)
    png = _out(args, "passkey.png")
    plot_heatmap(res, png, f"passkey retrieval: {ck.name}", train_len=ck.train_len)
    res["checkpoint"] = ck.path
    out = dict(task="passkey", result=res, plot=png, **_meta(args, ck.model.embed.weight.device))
    write_json(_out(args, "passkey.json"), out)
    print(f"passkey {ck.name}: mean accuracy {res['mean_accuracy']:.3f} over {len(args.lengths)} lengths x "
          f"{len(args.depths)} depths x {args.trials} trials; mean answer loss "
          f"{sum(map(sum, res['answer_loss'])) / (len(args.lengths) * len(args.depths)):.3f} nats per token")
    return out


def cmd_passkey_train(args) -> dict:
    from ttt_lm.config import ExperimentConfig
    from ttt_lm.eval.passkey import grid_keys, practice_finetune
    from ttt_lm.artifacts import save_export, tokenizer_file
    from ttt_lm.data import load_manifest
    if os.path.abspath(args.out) == os.path.abspath(args.checkpoint):
        raise EvalError(f"--out {args.out} is the checkpoint itself; write the fine-tuned model elsewhere")
    if os.path.isdir(args.out) and os.listdir(args.out) and not args.overwrite:
        raise EvalError(f"--out {args.out} exists and is not empty; pass --overwrite to replace its model")
    ck = _load(args, args.checkpoint)
    tok = _tokenizer(args.tokenizer, ck, "passkey_train")
    tok_path = args.tokenizer or ck.tokenizer_path
    if os.path.isdir(tok_path):
        tok_path = tokenizer_file(tok_path) or load_manifest(tok_path, check_files=False)["tokenizer_path"]
    if args.dtype != "float32":
        raise EvalError(f"passkey_train trains in float32; got --dtype {args.dtype}")
    torch.manual_seed(args.seed)
    exclude = grid_keys(args.exclude_trials, args.eval_seed) if args.exclude_trials > 0 else []
    res = practice_finetune(ck.model, tok, args.lengths, args.steps, args.batch_size, args.lr, args.warmup,
                            args.seed, exclude=exclude, held_out=args.held_out, show_progress=_progress(args))
    cfg = ExperimentConfig(model=ck.model.cfg)
    if ck.data_path:
        cfg.data.path = ck.data_path
    cfg.data.seq_len = max(args.lengths)  # the longest practice prompt: the passkey plot marks it as "train"
    save_export(ck.model, cfg, args.out, tokenizer=tok_path)
    out = dict(task="passkey_train", checkpoint=ck.path, result=res, **_meta(args, ck.model.embed.weight.device))
    write_json(_out(args, "passkey_train.json"), out)
    b, a = res["before"], res["after"]
    print(f"passkey_train {ck.name} -> {args.out}: {args.steps} steps at lengths {args.lengths}; held-out answer "
          f"loss {b['answer_loss']:.3f} -> {a['answer_loss']:.3f}, answers fully right "
          f"{b['prompt_accuracy']:.0%} -> {a['prompt_accuracy']:.0%}")
    return out


def cmd_synthetic(args) -> dict:
    from ttt_lm.eval.synthetic import (build_tiny_lm, make_task, parse_impl, parse_mixer_spec, plot_accuracy,
                                       plot_accuracy_vs_width, result_dict, run_synthetic)
    task = make_task(args.task, args.vocab_size, num_kv_pairs=args.num_kv_pairs, num_tokens=args.num_tokens)
    if args.stop_at is not None and not 0 < args.stop_at <= 1:
        raise EvalError(f"--stop-at is an accuracy in (0, 1], got {args.stop_at}")
    if args.lrs is not None and (not args.lrs or min(args.lrs) <= 0):
        raise EvalError(f"--lrs needs positive learning rates, got {args.lrs}")
    widths = args.d_models or [args.d_model]
    try:
        parse_impl(args.impl)
    except ValueError as e:
        raise EvalError(f"--impl: {e}") from e
    seeds = args.seeds if args.seeds is not None else [args.seed]
    if not seeds or len(set(seeds)) < len(seeds) or min(seeds) < 0:
        raise EvalError(f"--seeds needs distinct non-negative seeds, got {args.seeds}")
    overrides = {}
    for kv in args.set or []:
        k, eq, v = kv.partition("=")
        if not eq or not k.strip():
            raise EvalError(f"--set takes KEY=VALUE (a model option, e.g. ttt.pre_conv=true), got {kv!r}")
        overrides[k.strip().removeprefix("model.")] = v.strip()
    for mixer in [m for m in args.mixers.split(",") if m] if overrides else []:
        try:  # every model once, before any training: a bad option fails here, not after hours
            build_tiny_lm(parse_mixer_spec(mixer), task.vocab_size, n_layers=args.n_layers, d_model=widths[0],
                          n_heads=args.n_heads, max_seq_len=args.train_len, overrides=overrides)
        except ValueError as e:
            raise EvalError(f"--set with {mixer}: {e}") from e
    torch.manual_seed(seeds[0])
    results = []
    for mixer in [m for m in args.mixers.split(",") if m]:
        for d in widths:
            for seed in seeds:
                t0 = time.time()
                r = run_synthetic(task, mixer, args.train_len, args.test_lens, args.steps,
                                  batch_size=args.batch_size, lr=args.lr, d_model=d, n_layers=args.n_layers,
                                  n_heads=args.n_heads, num_eval=args.num_eval, seed=seed, device=str(args.dev),
                                  progress=not args.no_progress, stop_at=args.stop_at, impl=args.impl,
                                  lrs=args.lrs, eval_chunk_len=args.eval_chunk_len, check_every=args.check_every,
                                  overrides=overrides)
                results.append(r)
                # after every model, so that a long sweep stopped part way keeps what it finished
                write_json(_out(args, f"{task.name}.json"),
                           dict(task="synthetic", synthetic_task=task.name, partial=True,
                                results=[result_dict(x) for x in results], **_meta(args, args.dev)))
                solved = (f"solved in {r.steps_to_solve} steps" if r.steps_to_solve is not None
                          else f"not solved in {args.steps} steps" if args.stop_at is not None
                          else f"{args.steps} steps, no criterion")
                print(f"{task.name} {mixer} d_model={d} seed={seed} lr={r.lr:g} ({solved}): "
                      + "  ".join(f"{T}: {a:.2f}" for T, a in r.accuracy.items())
                      + f"  ({time.time() - t0:.0f}s)", flush=True)
    table = _tables(results)
    crit = (f"until accuracy >= {args.stop_at} at length {args.train_len} (checked every {args.check_every} "
            f"steps) or {args.steps} steps" if args.stop_at is not None else f"for {args.steps} steps")
    lrs = f"learning rates {', '.join(f'{x:g}' for x in args.lrs)} (the best kept)" if args.lrs else f"lr {args.lr:g}"
    hdr = (f"# {task.name}: accuracy vs sequence length\n\n"
           f"Trained at length {args.train_len} (*) {crit}, batch {args.batch_size}, {lrs}; "
           f"{args.n_layers} layers, d_model {', '.join(map(str, widths))}, vocabulary {task.vocab_size}; "
           f"{args.num_eval} test sequences per length, read {args.eval_chunk_len} tokens at a time with state "
           f"carried; chance {task.chance:.3f}; seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))} "
           f"(each seed draws the initial weights, the training batches and the test sequences).\n\n")
    with open(_out(args, f"{task.name}.md"), "w") as f:
        f.write(hdr + table)
    png = _out(args, f"{task.name}.png")
    plot_accuracy(results, png, f"{task.name} (trained at {args.train_len})")
    out = dict(task="synthetic", synthetic_task=task.name, partial=False, results=[result_dict(r) for r in results],
               table=table, plot=png, **_meta(args, args.dev))
    if len(widths) > 1:
        out["width_plot"] = _out(args, f"{task.name}_width.png")
        plot_accuracy_vs_width(results, out["width_plot"],
                               f"{task.name}: accuracy at length {args.train_len} vs width and state size")
    write_json(_out(args, f"{task.name}.json"), out)
    print(table)
    return out


def _tables(results) -> str:
    """The markdown tables of synthetic results: one row per run; where some model ran with several
    seeds, first a summary across seeds (:func:`~ttt_lm.eval.synthetic.seeds_table`)."""
    from ttt_lm.eval.synthetic import results_table, seeds_table, several_seeds
    if not several_seeds(results):
        return results_table(results)
    keys = ([">N: not solved in the budget N"] if any(r.criterion for r in results) else []) + (
        ["N (no criterion): trained N steps without one"] if not all(r.criterion for r in results) else [])
    return (f"Across seeds (solved: how many met the criterion; steps to solve in seed order, {'; '.join(keys)}; "
            "accuracy: mean over the seeds (min–max)):\n\n" + seeds_table(results)
            + "\nEvery run:\n\n" + results_table(results))


def _fill_seeds(saved: dict, key: str = "results") -> list:
    """The results of one saved synthetic JSON, each with its seed and whether it was trained to a
    criterion. Results saved before they carried these take them from the run's arguments (of a
    report: its sources' seed and ``stop_at``, which they shared)."""
    from ttt_lm.eval.synthetic import result_from_dict
    runs = [s.get("args") or {} for s in saved["sources"]] if _is_report(saved) else [saved.get("args") or {}]
    seeds = {a.get("seed") for a in runs}
    default = int(next(iter(seeds)) or 0) if len(seeds) == 1 else 0
    criterion = any(a.get("stop_at") is not None for a in runs)
    out = []
    for d in saved.get(key, []):
        r = result_from_dict(d)
        if "seed" not in d:
            r.seed = default
        if "criterion" not in d:
            r.criterion = criterion
        out.append(r)
    return out


def _load_synthetic_json(src: str, task: str) -> tuple:
    """(path, saved dict) of one ``--from`` entry: a results JSON, or a directory holding ``<task>.json``."""
    path = os.path.join(src, f"{task}.json") if os.path.isdir(src) else src
    if not os.path.isfile(path):
        raise EvalError(f"--from {src}: no {'file ' + path if os.path.isdir(src) else 'such file'} "
                        f"(a synthetic run writes <out>/{task}.json)")
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise EvalError(f"--from {path}: not a readable JSON file ({e})") from e
    if not isinstance(saved, dict) or saved.get("task") != "synthetic" or not isinstance(saved.get("results"), list):
        raise EvalError(f"--from {path}: not the JSON of a synthetic run (no task 'synthetic' with results)")
    if saved.get("synthetic_task") != task:
        raise EvalError(f"--from {path}: holds the task {saved.get('synthetic_task')!r}, not {task!r} (--task)")
    if not saved["results"]:
        raise EvalError(f"--from {path}: holds no finished model")
    return path, saved


def _is_report(saved: dict) -> bool:
    """Whether a synthetic JSON is a merged report (``synthetic_report``'s output) rather than one run."""
    return isinstance(saved.get("sources"), list)


def _run_entries(path: str, saved: dict) -> List[dict]:
    """The runs behind one ``--from`` entry, each as a report's ``sources`` lists them (path, args, date,
    commit, device, partial, mixers, train_seconds): a run is itself; a merged report, its sources."""
    from ttt_lm.eval.synthetic import result_from_dict
    if not _is_report(saved):
        rs = [result_from_dict(d) for d in saved["results"]]
        return [dict(path=path, args=saved.get("args"), date=saved.get("date"), commit=saved.get("commit"),
                     device=saved.get("device"), partial=saved.get("partial"), mixers=[r.mixer for r in rs],
                     train_seconds=sum(r.train_seconds for r in rs))]
    out = []
    rows = [result_from_dict(d) for d in saved["results"]] + [result_from_dict(d) for d in saved.get("replaced", [])]
    for s in saved["sources"]:
        s = dict(s)
        a = s.get("args") or {}
        if "mixers" not in s:
            s["mixers"] = [m for m in str(a.get("mixers", "")).split(",") if m]
        if "train_seconds" not in s:   # reports written before sources carried it: the seconds of its lr trials
            lrs = set(a.get("lrs") or [a.get("lr")])
            widths = set(a.get("d_models") or [a.get("d_model")])
            s["train_seconds"] = sum(t.get("seconds", 0.0) for r in rows if r.mixer in s["mixers"] and
                                     r.d_model in widths for t in r.lr_trials if t["lr"] in lrs)
        s.setdefault("via", path)
        out.append(s)
    return out


def cmd_synthetic_report(args) -> dict:
    """Merge the JSON of several ``synthetic`` runs (e.g. one per mixer, or one per lr) into one table,
    one accuracy plot and, with several widths, the width plot; nothing is trained. A ``--from``
    entry may also be an earlier merged report: its rows are kept, and brought up to date by the
    runs given beside it (:func:`~ttt_lm.eval.synthetic.update_report`); the rows those runs
    replace are listed in the report, not dropped from it."""
    from ttt_lm.eval.synthetic import (PROTOCOL_KEYS, make_task, merge_results, plot_accuracy,
                                       plot_accuracy_vs_width, result_dict, result_trials, trial_accuracy,
                                       update_report)
    srcs = [s for s in args.sources.split(",") if s.strip()]
    if not srcs:
        raise EvalError("--from needs at least one run directory or results JSON")
    out_json = os.path.abspath(os.path.join(args.out, f"{args.task}.json"))
    loaded = [_load_synthetic_json(s.strip(), args.task) for s in srcs]
    paths = [p for p, _ in loaded]
    if len(set(map(os.path.abspath, paths))) < len(paths):
        raise EvalError(f"--from names the same results more than once: {', '.join(paths)}")
    if out_json in map(os.path.abspath, paths):
        raise EvalError(f"--out {args.out} would overwrite the source {out_json}; write the merged report elsewhere")
    drop = set(args.drop or [])
    if drop:   # rows of the earlier reports left out by name (e.g. after the mixer changed), with their runs
        named = {d["mixer"] for _, s in loaded if _is_report(s) for key in ("results", "left_out", "replaced")
                 for d in s.get(key, [])}
        if drop - named:
            raise EvalError(f"--drop {', '.join(sorted(drop - named))}: no row of the reports given has that name "
                            f"(they have: {', '.join(sorted(named)) or 'no report among --from'})")
    dropped, dropped_runs = [], []
    for path, saved in loaded:
        if _is_report(saved):
            dropped += [r for key in ("results", "left_out", "replaced") for r in _fill_seeds(saved, key)
                        if r.mixer in drop]
            dropped += [r for r in _fill_seeds(saved, "dropped")]
            dropped_runs += [dict(s, via=s.get("via", path)) for s in saved.get("dropped_sources", [])]
    runs_of = [(p, _run_entries(p, s)) for p, s in loaded]
    entries = []
    for _, es in runs_of:
        for e in es:
            gone = bool(e.get("mixers")) and set(e["mixers"]) <= drop and e.get("via") is not None
            (dropped_runs if gone else entries).append(e)
    if not entries:
        raise EvalError(f"--drop {', '.join(sorted(drop))} leaves no run to report")
    seen_runs = {}
    for e in entries:
        if os.path.abspath(e["path"]) in seen_runs:
            raise EvalError(f"the run {e['path']} is in both {seen_runs[os.path.abspath(e['path'])]} and "
                            f"{e.get('via', e['path'])}")
        seen_runs[os.path.abspath(e["path"])] = e.get("via", e["path"])
    first = entries[0]
    for e in entries[1:]:
        for k in PROTOCOL_KEYS:
            a, b = (first.get("args") or {}).get(k), (e.get("args") or {}).get(k)
            if a != b:
                raise EvalError(f"runs with different protocols cannot share a table: {k} is {a!r} in "
                                f"{first.get('via', first['path'])} and {b!r} in {e.get('via', e['path'])}")
    old, old_names, new, new_names, replaced = [], [], [], [], []
    for path, saved in loaded:
        rows = _fill_seeds(saved)
        if _is_report(saved):
            rows += _fill_seeds(saved, "left_out")      # rows an earlier --d-models filter set aside
            rows = [r for r in rows if r.mixer not in drop]
            old += rows
            old_names += [path] * len(rows)
            replaced += [r for r in _fill_seeds(saved, "replaced") if r.mixer not in drop]
        else:
            new += rows
            new_names += [path] * len(rows)
    try:
        merged_old, merged_new = merge_results(old, old_names), merge_results(new, new_names)
        reports = ", ".join(p for p, s in loaded if _is_report(s)) or "the reports"
        merged, now_replaced = update_report(merged_old, merged_new, reports)
    except ValueError as e:
        raise EvalError(str(e)) from e
    replaced += now_replaced
    left_out = []
    if args.d_models:
        left_out = [r for r in merged if r.d_model not in args.d_models]
        merged = [r for r in merged if r.d_model in args.d_models]
        if not merged:
            raise EvalError(f"--d-models {','.join(map(str, args.d_models))}: no row at these widths (the runs have "
                            f"{', '.join(str(w) for w in sorted({r.d_model for r in left_out}))})")
    a = first.get("args") or {}
    task = make_task(args.task, a.get("vocab_size"), num_kv_pairs=a.get("num_kv_pairs"),
                     num_tokens=a.get("num_tokens"))
    T = merged[0].train_len
    crit = (f"until accuracy >= {a['stop_at']} at length {T} (checked every {a.get('check_every')} steps) or its "
            f"budget" if a.get("stop_at") is not None else "for its budget")
    widths = sorted({r.d_model for r in merged if r.d_model is not None})
    hdr = (f"# {args.task}: accuracy vs sequence length\n\n"
           + (f"{args.title}\n\n" if args.title else "")
           + f"Merged from {len(entries)} runs (`python -m ttt_lm.eval synthetic_report`). Every model trained at "
           f"length {T} (*) {crit}, batch {a.get('batch_size')}; {a.get('n_layers')} layers, d_model "
           f"{', '.join(map(str, widths))}, vocabulary {task.vocab_size}; {a.get('num_eval')} test sequences per "
           f"length, read {a.get('eval_chunk_len')} tokens at a time with state carried; chance {task.chance:.3f}. "
           f"The lr column is the one kept of those tried (below).\n\n")
    runs = ["", "## Runs", "", "| results | mixers | seed | budget | lrs | impl | date | commit | training s |",
            "|---|---|---:|---:|---|---|---|---|---:|"]
    for e in entries:
        sa = e.get("args") or {}
        lrs = sa.get("lrs") or [sa.get("lr")]
        runs.append(f"| {os.path.relpath(e['path'])}{' (partial)' if e.get('partial') else ''} | "
                    f"{', '.join(e['mixers'])} | {sa.get('seed')} | {sa.get('steps')} | "
                    f"{', '.join(f'{x:g}' for x in lrs)} | "
                    f"{sa.get('impl')} | {e.get('date') or ''} | {e.get('commit') or ''} | "
                    f"{e['train_seconds']:.0f} |")

    def trial_rows(rs):
        for r in rs:
            for t in result_trials(r):
                solved, budget = t.get("steps_to_solve"), t["budget"]
                steps = (solved if solved is not None else f"not solved in {budget}" if r.criterion
                         else "no criterion")
                acc = trial_accuracy(r, t)
                other = ("" if acc is None else
                         ", ".join(f"{T}: {a:.2f}" for T, a in sorted(acc.items()) if T != r.train_len))
                yield (f"| {r.mixer} | {r.d_model} | {r.seed} | {t['lr']:g} | {budget} | {steps} | "
                       f"{t['train_acc']:.2f} | {other} | {t['final_train_loss']:.3f} | "
                       f"{t.get('seconds', float('nan')):.0f} |")

    head = ("| mixer | d_model | seed | lr | budget | steps to solve | accuracy at the train length | at the other "
            "test lengths | final train loss | seconds |")
    rule = "|---|---:|---:|---:|---:|---|---:|---|---:|---:|"
    trials = ["", "## Every lr tried", "",
              "At the other test lengths: blank where that model was tested at the train length only (an lr "
              "its own sweep did not keep, or a run joined into a row before reports kept these).", "",
              head, rule, *trial_rows(merged)]
    if replaced:
        trials += ["", "## Replaced by later runs", "",
                   "Rows of an earlier report that a later run of the same model and lrs replaced (e.g. with a "
                   "larger budget); kept here so that nothing measured is dropped.", "", head, rule,
                   *trial_rows(replaced)]
    if dropped:
        trials += ["", "## Dropped from the earlier reports (--drop)", "",
                   f"Rows of the reports given that were left out by name ({', '.join(sorted({r.mixer for r in dropped}))}), "
                   f"e.g. because the model changed since they ran: not in the table or the figures, kept here and "
                   f"in the JSON (`dropped`, and their runs in `dropped_sources`: "
                   f"{', '.join(os.path.relpath(e['path']) for e in dropped_runs) or 'none listed'}).", "", head, rule,
                   *trial_rows(dropped)]
    if left_out:
        trials += ["", "## Other widths (left out by --d-models)", "",
                   f"Rows of the runs above at widths other than {', '.join(map(str, args.d_models))}: not in the "
                   "table or the figures, kept here and in the JSON (`left_out`).", "", head, rule,
                   *trial_rows(left_out)]
    table = _tables(merged)
    os.makedirs(args.out, exist_ok=True)
    with open(_out(args, f"{args.task}.md"), "w") as f:
        f.write(hdr + table + "\n".join(runs + trials) + "\n")
    png = _out(args, f"{args.task}.png")
    plot_accuracy(merged, png, f"{args.task} (trained at {T})", chance=task.chance)
    out = dict(task="synthetic", synthetic_task=args.task, partial=any(e.get("partial") for e in entries),
               results=[result_dict(r) for r in merged], table=table, plot=png,
               replaced=[result_dict(r) for r in replaced], left_out=[result_dict(r) for r in left_out],
               sources=[{k: v for k, v in e.items() if k != "via"} for e in entries],
               dropped=[result_dict(r) for r in dropped],
               dropped_sources=[{k: v for k, v in e.items() if k != "via"} for e in dropped_runs], **_meta(args, args.dev))
    if len(widths) > 1:
        out["width_plot"] = _out(args, f"{args.task}_width.png")
        plot_accuracy_vs_width(merged, out["width_plot"],
                               f"{args.task}: accuracy at length {T} vs width and state size", chance=task.chance)
    write_json(out_json, out)
    print(table)
    return out


def cmd_lm_eval(args) -> dict:
    from lm_eval.utils import handle_non_serializable

    from ttt_lm.eval.lm_eval_adapter import run_tasks
    res = run_tasks(args.checkpoint, [t for t in args.tasks.split(",") if t], args.include_path, args.limit,
                    args.num_fewshot, args.tokenizer, args.device, args.dtype, args.chunk_len, args.seed,
                    args.batch_size, args.bootstrap_iters, args.log_samples)
    out = dict(task="lm_eval", results=res.get("results", {}), versions=res.get("versions", {}),
               n_samples=res.get("n-samples", {}), **_meta(args, args.dev))
    write_json(_out(args, "lm_eval.json"), out)
    if args.log_samples:
        d = _out(args, "lm_eval_samples")
        os.makedirs(d, exist_ok=True)
        for task, samples in res.get("samples", {}).items():
            with open(os.path.join(d, f"{task}.jsonl"), "w") as f:
                for s in samples:
                    f.write(json.dumps(s, default=handle_non_serializable, ensure_ascii=False) + "\n")
    for t, r in out["results"].items():
        print(f"lm_eval {t}: " + "  ".join(f"{k}={v:.4f}" for k, v in r.items() if isinstance(v, float)))
    return out


# ---- parser --------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ttt_lm.eval", description="Evaluate ttt-lm checkpoints.")
    sub = ap.add_subparsers(dest="task", required=True)

    def common(p, checkpoint=True, multi=False):
        if checkpoint:
            if multi:
                p.add_argument("--checkpoint", action="append", required=True,
                               help="export dir (model.pt + config.yaml) or run dir; repeat for several")
            else:
                p.add_argument("--checkpoint", required=True, help="export dir (model.pt + config.yaml) or run dir")
        p.add_argument("--out", default="eval_results", help="directory for the JSON result and plots")
        p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
        p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float64")
        p.add_argument("--no-progress", action="store_true")
        p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("perplexity", help="loss, perplexity and bits per byte on a validation split or text")
    common(p)
    p.add_argument("--data", help="prepared data dir (default: the checkpoint config's data.path)")
    p.add_argument("--split", default="val", help="val (the validation loader) or train")
    p.add_argument("--text", help="a UTF-8 text file to score instead of prepared data (needs a tokenizer)")
    p.add_argument("--tokenizer", help=".model file or prepared data dir (for --text)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per window (default: the checkpoint's training context, its data.seq_len; "
                        "else min(model.max_seq_len, 2048))")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-batches", type=int, default=None)
    p.set_defaults(func=cmd_perplexity)

    p = sub.add_parser("long_context", help="loss by token position over whole documents")
    common(p, multi=True)
    p.add_argument("--names", help="comma-separated legend labels, one per --checkpoint")
    p.add_argument("--data", help="prepared data dir (default: the checkpoint config's data.path)")
    p.add_argument("--split", default="val")
    p.add_argument("--max-len", type=int, required=True, help="tokens of each document to score")
    p.add_argument("--lengths", type=_ints, default=None, help="context lengths to report the mean loss at")
    p.add_argument("--chunk-len", type=int, default=2048, help="tokens per forward; states carried between")
    p.add_argument("--min-len", type=int, default=None, help="skip shorter documents (default max-len + 1)")
    p.add_argument("--max-docs", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--buckets", type=int, default=32)
    p.add_argument("--windows", action="store_true",
                   help="cut every document into consecutive pieces of max-len + 1 tokens, each scored from an "
                        "empty state (many contexts from a few long documents)")
    p.add_argument("--train-len", type=int, default=None,
                   help="training context to mark on the plot (default: the checkpoint config's data.seq_len)")
    p.set_defaults(func=cmd_long_context)

    p = sub.add_parser("passkey", help="passkey retrieval over context lengths x depths (heatmap)")
    common(p)
    p.add_argument("--tokenizer", help=".model file or prepared data dir (default: beside the checkpoint)")
    p.add_argument("--lengths", type=_ints, default=[256, 512, 1024, 2048])
    p.add_argument("--depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--chunk-len", type=int, default=2048)
    p.set_defaults(func=cmd_passkey)

    p = sub.add_parser("passkey_train", help="fine-tune a checkpoint on passkey prompts, loss on the answer only; "
                                             "writes an export directory")
    p.add_argument("--checkpoint", required=True, help="export dir (model.pt + config.yaml) or run dir")
    p.add_argument("--out", required=True, help="export directory to write (model.pt, config.yaml, tokenizer, "
                                                "passkey_train.json)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    p.add_argument("--tokenizer", help=".model file or prepared data dir (default: beside the checkpoint)")
    p.add_argument("--lengths", type=_ints, default=[128, 256], help="practice context lengths (one per batch)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--held-out", type=int, default=64, help="prompts scored before and after (answer loss)")
    p.add_argument("--exclude-trials", type=int, default=1000,
                   help="never train on the first N keys the passkey eval tests with --eval-seed")
    p.add_argument("--eval-seed", type=int, default=0, help="the --seed the passkey eval will use")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", help="float32 (training)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--seed", type=int, default=0, help="seed of the practice prompts and of training")
    p.set_defaults(func=cmd_passkey_train)

    p = sub.add_parser("synthetic", help="train tiny models on a recall task and test length generalization")
    common(p, checkpoint=False)
    p.add_argument("--task", default="induction", help="induction | mqar | selective_copying")
    p.add_argument("--mixers", default="attention,mamba",
                   help="comma-separated layer kinds; a+b is the hybrid pattern [a, b]")
    p.add_argument("--train-len", type=int, default=256)
    p.add_argument("--test-lens", type=_ints, default=[64, 128, 256, 512, 1024, 2048, 4096])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--stop-at", type=float, default=None,
                   help="stop training once accuracy at the train length reaches this")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lrs", type=_floats, default=None,
                   help="comma-separated learning rates to sweep per mixer (e.g. 3e-4,1e-3,3e-3); the one that "
                        "reaches --stop-at in the fewest steps is kept, else the most accurate (overrides --lr)")
    p.add_argument("--check-every", type=int, default=50, help="steps between --stop-at checks")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--d-models", type=_ints, default=None,
                   help="comma-separated widths: train every mixer at each (Zoology's accuracy-vs-width sweep; "
                        "also plots accuracy against state size)")
    p.add_argument("--eval-chunk-len", type=int, default=512,
                   help="tokens per forward at test time; states carried from chunk to chunk")
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=None, help="default: induction 16, mqar 256, copying 16")
    p.add_argument("--num-kv-pairs", type=int, default=None, help="mqar (default 8)")
    p.add_argument("--num-tokens", type=int, default=None, help="selective copying (default 8)")
    p.add_argument("--num-eval", type=int, default=64, help="test sequences per length")
    p.add_argument("--seeds", type=_ints, default=None,
                   help="comma-separated seeds: train every mixer (and width) once per seed, each with the whole "
                        "lr sweep; the tables and plot then summarize the seeds (overrides --seed)")
    p.add_argument("--impl", default="chunked",
                   help="mixer form: chunked | reference for every mixer, or per kind, e.g. "
                        "mamba=reference,rglru=reference; the sequential reference forms compute the same "
                        "function, and on a CPU they train these tiny models faster at short lengths "
                        "(64 tokens); at 256 the chunked forms are faster")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="change a model option of every model of the run (repeatable), e.g. --set ttt.pre_conv=true "
                        "or --set titans.segment_len=16; the rows are then named '<mixer> [KEY=VALUE]'")
    p.set_defaults(func=cmd_synthetic)

    p = sub.add_parser("synthetic_report", help="merge saved synthetic runs into one table and plot (no training)")
    p.add_argument("--from", dest="sources", required=True,
                   help="comma-separated run directories (each holding <task>.json) or results JSON files")
    p.add_argument("--task", default="induction", help="induction | mqar | selective_copying")
    p.add_argument("--out", default="eval_results", help="directory for <task>.json, .md and .png")
    p.add_argument("--title", default="", help="a paragraph for the top of <task>.md (e.g. how runs were shortened)")
    p.add_argument("--d-models", type=_ints, default=None,
                   help="comma-separated widths: only rows at these go into the table and figures; the others are "
                        "listed apart in <task>.md and kept in the JSON (left_out)")
    p.add_argument("--drop", action="append", metavar="NAME",
                   help="a row name of the earlier reports among --from (as the table writes it, e.g. titans_mac or "
                        "'ttt_linear [ttt.pre_conv=true]'; repeatable): its rows and the runs behind them leave the "
                        "table and the figures (e.g. after the model changed), listed apart in <task>.md and kept "
                        "in the JSON (dropped, dropped_sources); runs given directly are never dropped")
    p.set_defaults(func=cmd_synthetic_report, device="cpu")

    p = sub.add_parser("lm_eval", help="run lm-evaluation-harness tasks on a checkpoint")
    common(p)
    p.add_argument("--tasks", required=True, help="comma-separated lm_eval task names")
    p.add_argument("--include-path", help="directory of extra task YAMLs")
    p.add_argument("--limit", type=float, default=None)
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--tokenizer", help=".model file or prepared data dir (default: beside the checkpoint)")
    p.add_argument("--chunk-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=1, help="requests scored (or generated) together")
    p.add_argument("--bootstrap-iters", type=int, default=100000,
                   help="lm_eval's bootstrap resamples for standard errors (0: none)")
    p.add_argument("--log-samples", action="store_true",
                   help="also write every request and response to <out>/lm_eval_samples/<task>.jsonl")
    p.set_defaults(func=cmd_lm_eval)
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from ttt_lm.config import ConfigError
    from ttt_lm.data import DataError
    from ttt_lm.data.tokenizer import TokenizerError
    args.dist = SINGLE
    args.written = []
    try:
        world = detect_env().world_size
        if world > 1 and args.task not in DISTRIBUTED_TASKS:
            raise EvalError(f"{args.task} runs as one process; launch it without torchrun/srun "
                            f"(tasks that run distributed: {', '.join(DISTRIBUTED_TASKS)})")
        args.dist, args.dev = init_distributed(args.device)
        args.func(args)
        _say_written(args)
    except (EvalError, DataError, TokenizerError, ConfigError) as e:
        print(f"error{f' (rank {args.dist.rank})' if args.dist.distributed else ''}: {e}", file=sys.stderr)
        return 2
    finally:
        args.dist.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
