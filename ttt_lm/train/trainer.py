"""The training loop: DeepSpeed engine, checkpoints, exact resume, preemption and metrics.

``main(argv)`` is what ``train.py`` runs; ``train(cfg)`` runs a resolved ExperimentConfig and
returns the process exit status (0, or PREEMPTED_EXIT_CODE after a preemption checkpoint).

One step = ``train.grad_accum`` micro-batches per rank, then one optimizer update. With
``parallel.tensor_parallel`` = p > 1 the model is built whole from the same seed on every rank,
then ``parallelize_tp`` keeps this rank's slice; the p ranks of a TP group read the same batches
(the loaders are split over the world / p data-parallel ranks). With
``parallel.context_parallel`` = c > 1 the c ranks of a CP group also read the same batches and each
computes its contiguous slice of every row (``ttt_lm.train.context.ContextParallelLM``); DeepSpeed
averages gradients over the dp × c ranks. A step whose
loss is NaN/Inf on any rank is skipped: DeepSpeed sees a non-finite gradient norm and drops the
update (optimizer state and the lr schedule do not move); the loop counts it and stops with
NonFiniteLossError after ``train.max_nonfinite_steps`` of them in a row.
"""
from __future__ import annotations

import math
import os
import random
import sys
import time
from typing import Optional, Sequence

import numpy as np

from ttt_lm.config import ConfigError, load_config, save_config, to_yaml
from ttt_lm.train.preempt import PREEMPTED_EXIT_CODE, PreemptionFlag

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "configs", "tiny.yaml")
#: model-config keys that may differ on resume: they choose kernels, not the model's shape
RUNTIME_MODEL_KEYS = ("kernel_backend", "attention.backend")


class NonFiniteLossError(RuntimeError):
    pass


def _pos(batch: dict, dev):
    """Position of each token in its document (0 at a document's first token), which the model
    uses to reset its state at document boundaries when model.reset_at_doc_boundaries is set."""
    p = batch.get("position_ids")
    return None if p is None else p.to(dev, non_blocking=True)


def parse_args(argv: Sequence[str]):
    # the deepspeed launcher appends --local_rank=N; the rank comes from the environment instead
    argv = [a for a in argv if not a.startswith("--local_rank")]
    if argv and argv[0] in ("-h", "--help"):
        print("usage: python train.py [config.yaml] [dotted.key=value ...]\n"
              f"  with no config, runs {os.path.relpath(DEFAULT_CONFIG)} (tiny hybrid on the bundled corpus, CPU)")
        sys.exit(0)
    path = DEFAULT_CONFIG
    if argv and "=" not in argv[0]:
        path = argv.pop(0)
    return path, argv


def main(argv: Optional[Sequence[str]] = None, data_api=None) -> int:
    path, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    from ttt_lm.train.checkpoint import CheckpointError
    from ttt_lm.data import DataError
    from ttt_lm.train.engine import ParallelConfigError
    try:
        cfg = load_config(path, overrides)
        return train(cfg, data_api=data_api)
    except (ConfigError, CheckpointError, ParallelConfigError, NonFiniteLossError, DataError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, (ConfigError, ParallelConfigError)) else 1


# ---- resume checks ---------------------------------------------------------------------------

def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def invariants(cfg, manifest: dict) -> dict:
    """What a resumed run must share with the checkpoint it resumes. ``tensor_parallel`` is among
    them: DeepSpeed writes the module and the ZeRO state per TP rank, sliced for that TP size; so
    is ``context_parallel``: ZeRO shards over data_parallel × context_parallel ranks."""
    from omegaconf import OmegaConf
    model = _flat(OmegaConf.to_container(OmegaConf.structured(cfg.model)))
    for k in RUNTIME_MODEL_KEYS:
        model.pop(k, None)
    return {"model": model, "data_path": os.path.normpath(cfg.data.path),
            "vocab_size": manifest.get("vocab_size"),
            "tokenizer": manifest.get("tokenizer_sha256") or manifest.get("tokenizer"),
            "tensor_parallel": cfg.parallel.tensor_parallel, "context_parallel": cfg.parallel.context_parallel}


def check_resume(saved: dict, now: dict, ckpt: str, dp_world: int) -> None:
    from ttt_lm.train.checkpoint import CheckpointError
    from omegaconf import OmegaConf
    from ttt_lm.model.config import ModelConfig
    inv = saved["invariants"]
    # a key the checkpoint lacks was added to the schema after it was written: its default is
    # what that run used
    defaults = _flat(OmegaConf.to_container(OmegaConf.structured(ModelConfig())))
    old = {**{k: v for k, v in defaults.items() if k in now["model"]}, **inv["model"]}
    diff = [f"model.{k}: {old.get(k)!r} -> {now['model'].get(k)!r}"
            for k in sorted(set(old) | set(now["model"])) if old.get(k) != now["model"].get(k)]
    for k in ("data_path", "vocab_size", "tokenizer"):
        if inv.get(k) != now.get(k):
            diff.append(f"{k}: {inv.get(k)!r} -> {now.get(k)!r}")
    # checkpoints written before tensor parallelism was recorded were all tensor_parallel=1
    tp_old, tp_new = inv.get("tensor_parallel", 1), now.get("tensor_parallel", 1)
    if tp_old != tp_new:
        raise CheckpointError(
            f"cannot resume from {ckpt}: it was written with parallel.tensor_parallel={tp_old} and this run has "
            f"{tp_new}; the weights and ZeRO optimizer state are stored as per-TP-rank slices. Resume with "
            f"parallel.tensor_parallel={tp_old}, or export the weights with `python -m ttt_lm.train.export {ckpt} "
            "<out>` (which consolidates the slices) and start a new run with train.init_from=<out> "
            "(fresh optimizer state)")
    cp_old, cp_new = inv.get("context_parallel", 1), now.get("context_parallel", 1)
    if cp_old != cp_new:
        raise CheckpointError(
            f"cannot resume from {ckpt}: it was written with parallel.context_parallel={cp_old} and this run has "
            f"{cp_new}; ZeRO's optimizer state is sharded over data_parallel × context_parallel ranks and the "
            f"data-loader states are per data-parallel rank. Resume with parallel.context_parallel={cp_old}, or "
            f"export the weights with `python -m ttt_lm.train.export {ckpt} <out>` and start a new run with "
            "train.init_from=<out> (fresh optimizer state)")
    if diff:
        raise CheckpointError(
            f"cannot resume from {ckpt}: the run changed what a resumed run must keep:\n  " + "\n  ".join(diff)
            + "\nrestore those settings, or start a new run (another train.run_dir)")
    if saved["dp_world"] != dp_world:
        raise CheckpointError(
            f"cannot resume from {ckpt}: it was written by {saved['dp_world']} data-parallel ranks and this run has "
            f"{dp_world}; ZeRO keeps optimizer state in per-rank shards. Resume on {saved['dp_world']} ranks, or "
            f"convert it to a rank-independent DeepSpeed universal checkpoint with\n"
            f"  python -m deepspeed.checkpoint.ds_to_universal --input_folder {ckpt}/ds "
            f"--output_folder {ckpt}/ds_universal\n"
            "(this trainer does not load universal checkpoints yet), or export the weights with "
            f"`python -m ttt_lm.train.export {ckpt} <out>` and start a new run with train.init_from=<out> "
            "(fresh optimizer state)")


# ---- the run ---------------------------------------------------------------------------------

def _device(cfg) -> str:
    import torch
    d = cfg.train.device
    if d == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if d not in ("cpu", "cuda"):
        raise ConfigError(f"train.device must be auto, cpu or cuda, got {d!r}")
    return d


def _seed_all(seed: int) -> None:
    import torch
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train(cfg, data_api=None) -> int:
    device = _device(cfg)
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed picks one
    from ttt_lm.train.engine import check_parallel
    from ttt_lm.train.dist import detect_env
    # before any process group exists: fail fast and the same on every rank
    check_parallel(cfg, detect_env().world_size)

    import torch
    import torch.distributed as tdist

    from ttt_lm.model import LM
    from ttt_lm.model.flops import flops_per_token
    from ttt_lm.parallel.groups import build_groups
    from ttt_lm.train import checkpoint as ck
    from ttt_lm.train.dist import init_distributed
    from ttt_lm.train.engine import build_engine
    from ttt_lm.train.metrics import MetricsWriter, memory_mb, mfu

    if data_api is None:
        import ttt_lm.data as data_api

    preempt = PreemptionFlag().install()
    env = init_distributed(device)
    rank, world = env.rank, env.world_size
    tp, cp = cfg.parallel.tensor_parallel, cfg.parallel.context_parallel
    # TP peers (consecutive ranks), then CP peers, see the same batches: the data is split dp ways
    groups = build_groups(tp_size=tp, cp_size=cp)
    dp_rank, dp_world = groups.dp_rank, groups.dp_size
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)))))
    dev = torch.device("cuda", env.local_rank) if device == "cuda" else torch.device("cpu")
    t, run_dir = cfg.train, cfg.train.run_dir
    ckpt_root = os.path.join(run_dir, "checkpoints")

    manifest = data_api.load_manifest(cfg.data.path)
    if manifest.get("vocab_size") is not None and manifest["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"vocab_size={manifest['vocab_size']} ({cfg.data.path}); set model.vocab_size >= it")
    inv = invariants(cfg, manifest)

    resume = ck.resolve(t.resume_from) if t.resume_from else ck.find_latest(ckpt_root)
    if resume is not None:
        check_resume(ck.read_state(resume), inv, resume, dp_world)

    _seed_all(t.seed)  # same initial weights on every rank: each TP rank slices the same full model
    if cp > 1:
        from ttt_lm.parallel.context_parallel import wait_pending
        from ttt_lm.train.context import ContextParallelLM
        model = ContextParallelLM(cfg.model, groups.cp_group)
    else:
        model = LM(cfg.model)
    model.activation_checkpointing = t.activation_checkpointing
    if t.init_from and resume is None:
        from ttt_lm.train.export import load_state_dict_into
        load_state_dict_into(model, t.init_from)  # full weights: the conversion below slices them
    n_params = model.num_params()  # of the whole model, before TP keeps a slice per rank
    # which implementation every layer kind runs here (never a silent fallback: kernel_backend=triton
    # where no kernel applies stops the run now, naming the layer kind)
    try:
        backends = model.kernel_backends(dev)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    pdims = {}
    if tp > 1:
        from ttt_lm.parallel.tp_model import parallelize_tp, partition_dims
        parallelize_tp(model, groups, cfg.parallel.sequence_parallel)
        pdims = {k: d for k, d in partition_dims(model).items() if d is not None}
    model.to(dev)
    # DeepSpeed's data-parallel group is dp × cp (the mpu's): those ranks average gradients
    engine, sched = build_engine(model, cfg, dp_world * cp, mpu=groups.mpu() if tp > 1 or cp > 1 else None)
    _seed_all(t.seed + 1 + rank)  # per-rank streams for anything random in the loop

    loader = data_api.build_train_loader(cfg.data, t.micro_batch_size, dp_rank, dp_world)
    step, tokens, skipped_total, nonfinite_run = 0, 0, 0, 0
    if resume is not None:
        state, rs = ck.load(engine, resume, rank)
        loader.load_state_dict(rs["loader"])
        step, tokens, skipped_total = state["step"], state["tokens"], state["skipped_steps"]
        nonfinite_run = state.get("nonfinite_in_a_row", 0)

    batches = iter(loader)  # after load_state_dict: continues with the next batch
    log = MetricsWriter(run_dir, cfg, enabled=rank == 0)
    if rank == 0:
        save_config(cfg, os.path.join(run_dir, "config.yaml"))
        print(f"[train] {'resuming from ' + resume if resume else 'starting'} at step {step}; "
              f"{world} rank(s) on {device} (data parallel {dp_world} × context parallel {cp} × tensor parallel {tp}"
              f"{', sequence parallel' if cfg.parallel.sequence_parallel else ''}), "
              f"ZeRO-{cfg.parallel.zero_stage}, {t.precision}, {n_params / 1e6:.2f}M parameters", flush=True)
        print("[train] kernels: " + ", ".join(f"{k} {v}" for k, v in backends.items())
              + f" (model.kernel_backend={cfg.model.kernel_backend})", flush=True)
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)["train"]
    cfg_yaml = to_yaml(cfg)

    def fwd_kw(b):
        # the tensor- and context-parallel forwards take no position_ids (check_parallel refuses
        # reset_at_doc_boundaries with them, the only use of them)
        return {} if tp > 1 or cp > 1 else {"position_ids": _pos(b, dev)}

    def save_ckpt():
        state = {"step": step, "tokens": tokens, "skipped_steps": skipped_total,
                 "nonfinite_in_a_row": nonfinite_run, "dp_world": dp_world, "invariants": inv,
                 "zero_stage": cfg.parallel.zero_stage, "tensor_parallel": tp, "context_parallel": cp,
                 # parameter name → dimension sliced across TP ranks (export concatenates along it)
                 "partition_dims": pdims, "time": time.time()}
        return ck.save(engine, ckpt_root, step, state, {"loader": loader.state_dict()}, cfg_yaml, rank,
                       cfg.checkpoint.keep_last)

    def evaluate():
        batches = []
        for b in data_api.build_val_loader(cfg.data, t.micro_batch_size, dp_rank, dp_world):
            batches.append(b)
            if len(batches) >= cfg.eval.batches:
                break
        # every rank must run the same number of forwards (ZeRO-3 gathers parameters in them)
        n = torch.tensor([len(batches)], dtype=torch.long)
        tdist.all_reduce(n, op=tdist.ReduceOp.MIN)
        tot = torch.zeros(2, dtype=torch.float64)
        engine.eval()
        with torch.no_grad():
            for b in batches[: int(n)]:
                labels = b["labels"].to(dev)
                out = engine(b["input_ids"].to(dev), labels=labels, **fwd_kw(b))
                # TP peers count the same batch: every replica weighs tp times, the mean is unchanged.
                # CP peers hold loss shares whose mean is the rows' mean loss: weighing each by the
                # rows' label count sums to cp × (the rows' summed loss) over cp × count.
                cnt = int((labels != -100).sum())
                tot += torch.tensor([float(out.loss) * cnt, cnt], dtype=torch.float64)
        engine.train()
        tdist.all_reduce(tot)
        return float(tot[0] / tot[1]) if tot[1] > 0 else float("nan")

    last_saved = step if resume is not None else -1
    bar = None
    if rank == 0 and cfg.logging.progress:
        from tqdm import tqdm
        bar = tqdm(total=t.max_steps, initial=step, desc="train", unit="step", dynamic_ncols=True, leave=True)

    exit_code = 0
    engine.train()
    while step < t.max_steps:
        t0 = time.perf_counter()
        lr = sched.get_last_lr()[0]
        loss_sum = torch.zeros((), dtype=torch.float64)
        local_tokens = 0
        for _ in range(t.grad_accum):
            b = next(batches)
            ids = b["input_ids"].to(dev, non_blocking=True)
            out = engine(ids, labels=b["labels"].to(dev, non_blocking=True), **fwd_kw(b))
            engine.backward(out.loss)
            if cp > 1:
                wait_pending()  # the state sends of the backward pass
            engine.step()
            loss_sum += out.loss.detach().to(torch.float64).cpu()
            local_tokens += ids.numel()
        # one collective per step: mean loss over ranks, and whether any rank was signalled.
        # TP peers hold the same (full, vocab-parallel) loss of the same batch and CP peers loss
        # shares whose mean is that loss, so the mean over the world is the mean over the
        # data-parallel replicas.
        agg = torch.tensor([float(loss_sum) / t.grad_accum, float(preempt.requested)], dtype=torch.float64)
        tdist.all_reduce(agg)
        loss = float(agg[0]) / world
        step += 1
        tokens += local_tokens * dp_world
        applied = engine.was_step_applied()
        skipped = not math.isfinite(loss) or not applied
        if skipped:
            skipped_total += 1
            nonfinite_run += 1
        else:
            nonfinite_run = 0
        gn = engine.get_global_grad_norm()
        gn = float(gn) if gn is not None else None
        dt = time.perf_counter() - t0
        tps = local_tokens * dp_world / dt
        rec = {"kind": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": gn if not skipped else None,
               "tokens": tokens, "tokens_per_s": tps, "mfu": mfu(tps, fpt, cfg.logging.peak_flops, world),
               "step_time_s": dt, "skipped": skipped, "skipped_total": skipped_total, **memory_mb(device)}
        log.log(rec)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:.0f}")
        if rank == 0 and cfg.logging.log_every and step % cfg.logging.log_every == 0 and bar is None:
            print(f"[train] step {step}/{t.max_steps} loss {loss:.4f} lr {lr:.3e} tok/s {tps:.0f}", flush=True)
        if nonfinite_run >= t.max_nonfinite_steps:
            raise NonFiniteLossError(
                f"loss was NaN/Inf for {nonfinite_run} steps in a row (steps {step - nonfinite_run + 1}..{step}; "
                f"train.max_nonfinite_steps={t.max_nonfinite_steps}); those updates were skipped. Lower optim.lr, "
                f"check the data, or resume from the last checkpoint in {ckpt_root}")
        if cfg.eval.every and step % cfg.eval.every == 0:
            vl = evaluate()
            log.log({"kind": "val", "step": step, "loss": vl, "ppl": math.exp(min(vl, 700.0))})
            if rank == 0 and bar is not None:
                bar.write(f"[val] step {step} loss {vl:.4f} ppl {math.exp(min(vl, 700.0)):.2f}")
        preempted = agg[1] > 0
        stop_here = t.stop_after is not None and step >= t.stop_after
        if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or preempted or stop_here:
            save_ckpt()
            last_saved = step
        if preempted:
            exit_code = PREEMPTED_EXIT_CODE
            if rank == 0:
                print(f"\n[train] preempted at step {step}: checkpoint saved; exiting with {exit_code}", flush=True)
            break
        if stop_here:
            break
    if exit_code == 0 and cfg.checkpoint.at_end and last_saved != step:
        save_ckpt()
    if bar is not None:
        bar.close()
    log.close()
    if rank == 0:
        latest = ck.find_latest(ckpt_root)
        print(f"[train] run directory: {os.path.abspath(run_dir)}\n"
              f"[train]   metrics:     {os.path.abspath(os.path.join(run_dir, 'metrics.jsonl'))}\n"
              + (f"[train]   tensorboard: {os.path.abspath(os.path.join(run_dir, 'tb'))}\n" if cfg.logging.tensorboard else "")
              + f"[train]   checkpoint:  {os.path.abspath(latest) if latest else '(none)'}", flush=True)
    preempt.uninstall()
    tdist.barrier()
    tdist.destroy_process_group()
    return exit_code
