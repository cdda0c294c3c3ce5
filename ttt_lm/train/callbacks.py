"""The training loop's callbacks: metrics, the non-finite-loss stop, evaluation, preemption and
checkpoints (``ttt_lm.train.trainer.Trainer`` calls their hooks).

``ttt_lm.train.trainer`` registers them in this order, which is the order of their ``post_step``
(``post_train`` runs in reverse)::

    MetricsCallback        each step's record to metrics.jsonl / TensorBoard / W&B, the console line
    NonFiniteLossCallback  NonFiniteLossError after train.max_nonfinite_steps non-finite losses in a row
    EvalCallback           validation loss every eval.every steps and at the last step (its batches read
                           once, then kept)
    PreemptionCallback     a signalled rank (SIGTERM/SIGUSR1) stops the run with PREEMPTED_EXIT_CODE
    CheckpointCallback     every checkpoint.every steps, on any stop request, and at the end

A step whose loss is non-finite on any rank is never checkpointed: the newest checkpoint is
always one saved after a finite loss. The metrics and non-finite checks act on the records of
``on_metrics``, which the trainer reads from the device every ``logging.log_every`` steps and at
checkpoint and evaluation steps (``ttt_lm.train.loop``); the checkpoint callback reads before it
saves, so it always knows whether the step's loss was finite.
"""
from __future__ import annotations

import math
import sys
from typing import Callable, List, Optional

from ttt_lm.train.loop import Callback
from ttt_lm.train.preempt import PREEMPTED_EXIT_CODE

#: the exit status of a run stopped by a bad shard found ahead of the reader (after its checkpoint)
DATA_ERROR_EXIT_CODE = 1


class NonFiniteLossError(RuntimeError):
    pass


class MetricsCallback(Callback):
    """Writes each step's record (with MFU and memory) through ``writer`` (a ``MetricsWriter``)
    when it is read, shows a tqdm progress bar on rank 0 when ``progress``, else prints a line every
    ``log_every`` steps. Closes the writer at the end."""

    def __init__(self, writer, device: str, flops_per_token: float, peak_flops: Optional[float],
                 log_every: int, progress: bool):
        self.writer, self.device, self.fpt, self.peak = writer, device, flops_per_token, peak_flops
        self.log_every, self.progress = log_every, progress
        self.bar = None

    def pre_train(self, trainer: "Trainer") -> None:
        if trainer.rank == 0 and self.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=trainer.max_steps, initial=trainer.step, desc="train", unit="step",
                            dynamic_ncols=True, leave=True)
            trainer.write = self.bar.write

    def on_metrics(self, trainer: "Trainer", records: List[dict]) -> None:
        """The records of the steps read at once (``Trainer.read_metrics``): each to the writer,
        the bar moved by their count, a console line for each step that is a multiple of
        ``log_every``."""
        from ttt_lm.train.metrics import memory_mb, mfu
        mem = memory_mb(self.device)
        for r in records:
            step, tps = r["step"], r["tokens_per_s"]
            rec = {**{k: r[k] for k in ("kind", "step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s")},
                   "mfu": mfu(tps, self.fpt, self.peak, trainer.world),
                   **{k: r[k] for k in ("step_time_s", "skipped", "skipped_total")}, **mem}
            self.writer.log(rec)
            loss, lr = rec["loss"], rec["lr"]
            if trainer.rank == 0 and self.log_every and step % self.log_every == 0 and self.bar is None:
                print(f"[train] step {step}/{trainer.max_steps} loss {loss:.4f} lr {lr:.3e} tok/s {tps:.0f}"
                      + (f" mfu {rec['mfu']:.1%}" if rec["mfu"] is not None else ""), flush=True)
        trainer.record = {**trainer.record, "mfu": rec["mfu"], **mem}
        if self.bar is not None:
            self.bar.update(len(records))
            self.bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:.0f}",
                                 **({"mfu": f"{rec['mfu']:.1%}"} if rec["mfu"] is not None else {}))

    def post_train(self, trainer: "Trainer") -> None:
        if self.bar is not None:
            self.bar.close()
        self.writer.close()


class NonFiniteLossCallback(Callback):
    """Ends the run with NonFiniteLossError after ``max_in_a_row`` steps in a row whose loss was
    NaN/Inf (their updates were skipped by DeepSpeed), naming the last good checkpoint."""

    def __init__(self, max_in_a_row: int, latest_checkpoint: Callable[[], Optional[str]]):
        self.max_in_a_row, self.latest_checkpoint = max_in_a_row, latest_checkpoint

    def on_metrics(self, trainer: "Trainer", records: List[dict]) -> None:
        """Checked when the steps' losses are read (``Trainer.read_metrics``: every
        ``logging.log_every`` steps in a run), so the run stops at that read, up to log_every − 1
        steps after the limit was reached; the error names the steps whose losses were non-finite."""
        bad = next((r for r in records if r["nonfinite_run"] >= self.max_in_a_row), None)
        if bad is not None:
            n, step = bad["nonfinite_run"], bad["step"]
            good = self.latest_checkpoint()  # no checkpoint is saved after a non-finite loss
            raise NonFiniteLossError(
                f"loss was NaN/Inf for {n} steps in a row (steps {step - n + 1}..{step}; "
                f"train.max_nonfinite_steps={self.max_in_a_row}); those updates were skipped. The last good "
                f"checkpoint is {good or '(none: the run starts from scratch)'}; running the same command again "
                "resumes from it, with a lower optim.lr (applied from the resumed step on) or after checking "
                "the data")


class EvalCallback(Callback):
    """Validation loss every ``every`` steps and at the last step (``max_steps``, when it is not a
    multiple of ``every``) over the first ``n_batches`` batches of ``build_loader()`` (built and read
    once, at the first evaluation; every pass then uses the same batches), averaged over label
    tokens and ranks; logged as a ``kind: val`` record with ``tokens``, the number of label tokens
    the mean is over (every data-parallel rank's batches, each token counted once). ``every`` = 0
    turns validation off, the last step's included."""

    def __init__(self, build_loader: Callable[[], object], every: int, n_batches: int, writer):
        self.build_loader, self.every, self.n_batches, self.writer = build_loader, every, n_batches, writer
        self.batches: Optional[List[dict]] = None
        self.tokens = 0  # label tokens of the last evaluation

    def _val_batches(self, trainer: "Trainer") -> List[dict]:
        if self.batches is None:
            import torch
            import torch.distributed as tdist
            batches = []
            for b in self.build_loader():
                batches.append(b)
                if len(batches) >= self.n_batches:
                    break
            # every rank must run the same number of forwards (ZeRO-3 gathers parameters in them)
            # collectives on the training device (NCCL reduces CUDA tensors only)
            n = torch.tensor([len(batches)], dtype=torch.long, device=trainer.device)
            tdist.all_reduce(n, op=tdist.ReduceOp.MIN)
            self.batches = batches[: int(n)]
        return self.batches

    def evaluate(self, trainer: "Trainer") -> float:
        """The mean validation loss; ``self.tokens`` is then how many label tokens it covered."""
        import torch
        import torch.distributed as tdist
        engine, dev = trainer.engine, trainer.device
        batches = self._val_batches(trainer)
        # the loss sum stays on the device; the host reads it once, after the last batch
        tot = torch.zeros(2, dtype=torch.float64, device=dev)
        engine.eval()
        with torch.no_grad():
            for b in batches:
                out = engine(b["input_ids"].to(dev), labels=b["labels"].to(dev), **trainer.forward_kwargs(b))
                # TP peers count the same batch: every replica weighs tp times, the mean is unchanged.
                # CP peers hold loss shares whose mean is the rows' mean loss: weighing each by the
                # rows' label count sums to cp × (the rows' summed loss) over cp × count.
                cnt = int((b["labels"] != -100).sum())      # on the loader's host copy: no sync
                tot[0] += out.loss.detach().to(torch.float64) * cnt
                tot[1] += cnt
        engine.train()
        tdist.all_reduce(tot)
        s, c = tot.tolist()
        # every TP and CP peer counted its rows' labels: each token was counted world / dp_world times
        self.tokens = int(round(c)) * trainer.dp_world // trainer.world
        return s / c if c > 0 else float("nan")

    def wants_metrics(self, trainer: "Trainer") -> bool:
        # the evaluation reads from the device anyway; the train records are written before its own
        return bool(self.every and trainer.step % self.every == 0)

    def post_step(self, trainer: "Trainer") -> None:
        step = trainer.step
        if not self.every or not (step % self.every == 0 or step == trainer.max_steps):
            return
        vl = self.evaluate(trainer)
        ppl = math.exp(min(vl, 700.0))
        n = len(self.batches or [])
        self.writer.log({"kind": "val", "step": step, "loss": vl, "ppl": ppl, "tokens": self.tokens})
        if trainer.rank == 0:
            trainer.write(f"[val] step {step} loss {vl:.4f} ppl {ppl:.2f} over {self.tokens:,} tokens "
                          f"({n} batch{'es' if n != 1 else ''} per rank × {trainer.dp_world} data-parallel rank"
                          f"{'s' if trainer.dp_world != 1 else ''})")


class PreemptionCallback(Callback):
    """When any rank was signalled during a step (``trainer.preempted``, from the step's
    collective), stops the run with PREEMPTED_EXIT_CODE; the checkpoint callback, after this one,
    saves the step. The Slurm scripts requeue a job that exits with it."""

    def __init__(self, why: Optional[Callable[[], Optional[str]]] = None):
        #: collective, after a stop: a reason other than a signal (a shard found bad ahead of the
        #: reader), or None; with one the run exits with DATA_ERROR_EXIT_CODE and says it
        self.why = why

    def post_step(self, trainer: "Trainer") -> None:
        if trainer.preempted:
            trainer.request_stop(PREEMPTED_EXIT_CODE)

    def post_train(self, trainer: "Trainer") -> None:
        reason = self.why() if trainer.preempted and self.why is not None else None
        if reason:
            trainer.exit_code = DATA_ERROR_EXIT_CODE
            if trainer.rank == 0:
                saved = "checkpoint saved" if trainer.last_saved == trainer.step else "no checkpoint (non-finite loss)"
                print(f"\n[train] stopped at step {trainer.step} ({saved}): {reason}", file=sys.stderr, flush=True)
            return
        if trainer.preempted and trainer.rank == 0:
            print(f"\n[train] preempted at step {trainer.step}: "
                  + ("checkpoint saved" if trainer.last_saved == trainer.step else "no checkpoint (non-finite loss)")
                  + f"; exiting with {trainer.exit_code}", flush=True)


class CheckpointCallback(Callback):
    """Saves a checkpoint through ``checkpointer`` (``ttt_lm.train.checkpoint.checkpointer.Checkpointer``:
    the engine and ``{"train_state": trainer}``, the trainer's whole resumable state) every
    ``every`` steps, after a step that requested a stop (preemption, train.stop_after), and at the
    end when ``at_end`` — never after a step whose loss was non-finite."""

    def __init__(self, checkpointer, rank: int, every: int, at_end: bool):
        self.checkpointer, self.rank, self.every, self.at_end = checkpointer, rank, every, at_end

    def save(self, trainer: "Trainer") -> str:
        from ttt_lm.train.checkpoint.checkpointer import TRAIN_STATE
        path = self.checkpointer.save(trainer.step, {TRAIN_STATE: trainer})
        trainer.last_saved = trainer.step
        return path

    def wants_metrics(self, trainer: "Trainer") -> bool:
        return bool(self.every and trainer.step % self.every == 0)   # whether the step's loss was finite

    def post_step(self, trainer: "Trainer") -> None:
        step = trainer.step
        if (self.every and step % self.every == 0) or trainer.stop_requested:
            trainer.read_metrics()   # a stop asked at a step that was not read: read it before deciding
            if trainer.nonfinite_run == 0:
                self.save(trainer)
            elif self.rank == 0:
                print(f"[train] no checkpoint at step {step}: its loss was non-finite "
                      f"({trainer.nonfinite_run} in a row); the newest checkpoint stays the last good one", flush=True)

    def post_train(self, trainer: "Trainer") -> None:
        trainer.read_metrics()   # nothing left after fit()'s own read; a no-op then
        if (trainer.exit_code == 0 and self.at_end and trainer.last_saved != trainer.step
                and trainer.nonfinite_run == 0):
            self.save(trainer)
