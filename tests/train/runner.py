"""Entry point of the training processes the tests spawn: ``python tests/train/runner.py
[key=value ...]`` trains like train.py, on a synthetic in-memory corpus with the data-pipeline
interface (so the tests need no prepared corpus), with fault injection from the environment:

    TTT_TEST_NAN_STEPS=3,4      the loss of those optimizer steps (1-based) is NaN
    TTT_TEST_CHECKSUMS=path     append Σ|θ| of the model before every training forward to path
    TTT_TEST_STEP_SLEEP=0.2     sleep that long in every training forward (to signal mid-run)
    TTT_TEST_DISK_FREE=bytes    the free space the checkpoint code sees (a disk about to fill up)
    TTT_TEST_CHECKSUM=x         the data manifest's checksum (the synthetic data's identity)
    TTT_TEST_LR_MULTS=path      append the TTT layers' η_base multipliers (lr_mult) before every
                                training forward to path
    TTT_TEST_REAL_DATA=1        train on the prepared corpus at data.path (ttt_lm.data) instead
    TTT_TEST_HOOK_LOG=path      register a callback (through ``main``'s ``callbacks``) that appends
                                "<hook> <step>" per hook call to path
    TTT_TEST_STOP_AT=k          that callback asks the run to stop after step k
    TTT_TEST_BATCH_LOG=path     with real data: append "<dp_rank> <sample:doc:pos> ..." (each row's
                                global sample index, and its first token's document and position)
                                per training batch, from the first rank of each data-parallel rank's
                                tensor/context-parallel peers only (they read the same batches)

Like train.py, it imports only ``ttt_lm.train`` before calling ``main`` (which installs the
preemption handler first); torch and the model load afterwards, as in a real start.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

VOCAB = 64


class SyntheticLoader:
    """Infinite, counter-based: batch i of rank r is a pure function of (seed, r, i), so the
    state is the counter. Each sequence counts up mod VOCAB from a random start: learnable."""

    def __init__(self, seq_len, batch_size, seed, rank, world, start=0, limit=None):
        self.T, self.B, self.seed, self.rank, self.world = seq_len, batch_size, seed, rank, world
        self.i, self.limit = start, limit

    def __iter__(self):
        return self

    def __next__(self):
        import torch
        if self.limit is not None and self.i >= self.limit:
            raise StopIteration
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 7919 + self.i)
        self.i += 1
        start = torch.randint(0, VOCAB, (self.B, 1), generator=g)
        seq = (start + torch.arange(self.T + 1)) % VOCAB
        return {"input_ids": seq[:, :-1].long(), "labels": seq[:, 1:].long()}

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, sd):
        self.i = sd["i"]


class SyntheticData:
    @staticmethod
    def build_train_loader(data_cfg, micro_batch_size, dp_rank, dp_world):
        _install_faults()
        return SyntheticLoader(data_cfg.seq_len, micro_batch_size, data_cfg.seed, dp_rank, dp_world)

    @staticmethod
    def build_val_loader(data_cfg, micro_batch_size, dp_rank, dp_world):
        return SyntheticLoader(data_cfg.seq_len, micro_batch_size, data_cfg.seed + 1, dp_rank, dp_world, limit=4)

    @staticmethod
    def load_manifest(path):
        return {"vocab_size": VOCAB, "tokenizer": "synthetic", "checksum": os.environ.get("TTT_TEST_CHECKSUM")}


class RealData:
    """ttt_lm.data, whose train loader logs what it yields (TTT_TEST_BATCH_LOG)."""

    def __getattr__(self, name):
        import ttt_lm.data
        return getattr(ttt_lm.data, name)

    @staticmethod
    def build_train_loader(data_cfg, micro_batch_size, dp_rank, dp_world, **kw):
        import ttt_lm.data
        _install_faults()
        loader = ttt_lm.data.build_train_loader(data_cfg, micro_batch_size, dp_rank, dp_world, **kw)
        path = os.environ.get("TTT_TEST_BATCH_LOG")
        peers = int(os.environ.get("WORLD_SIZE", "1")) // dp_world  # consecutive ranks read the same batches
        if path and int(os.environ.get("RANK", "0")) % peers == 0:
            inner = type(loader).__iter__

            def logged(self):
                for b in inner(self):
                    rows = zip(self.last_indices, b["doc_ids"][:, 0].tolist(), b["position_ids"][:, 0].tolist())
                    with open(path, "a") as f:
                        f.write(f"{dp_rank} " + " ".join(f"{i}:{d}:{p}" for i, d, p in rows) + "\n")
                    yield b

            loader.__class__ = type("LoggedTrainLoader", (type(loader),), {"__iter__": logged})
        return loader


def _install_faults():
    import torch
    from ttt_lm.model.lm import LM
    free = os.environ.get("TTT_TEST_DISK_FREE")
    if free:
        from ttt_lm.train import checkpoint
        checkpoint.free_bytes = lambda path: int(free)
    nan_steps = {int(s) for s in os.environ.get("TTT_TEST_NAN_STEPS", "").split(",") if s}
    sums_path = os.environ.get("TTT_TEST_CHECKSUMS")
    sleep = float(os.environ.get("TTT_TEST_STEP_SLEEP", "0"))
    mults_path = os.environ.get("TTT_TEST_LR_MULTS")
    if not (nan_steps or sums_path or sleep or mults_path):
        return
    fwd = LM.forward
    calls = {"n": 0}

    def forward(self, input_ids, labels=None, **kw):
        if not self.training:
            return fwd(self, input_ids, labels=labels, **kw)
        calls["n"] += 1  # with grad_accum=1 the n-th training forward is optimizer step n
        if sums_path:
            with torch.no_grad():
                s = sum(float(p.detach().double().abs().sum()) for p in self.parameters())
            with open(sums_path, "a") as f:
                f.write(f"{calls['n']} {s!r}\n")
        if mults_path:
            with open(mults_path, "a") as f:
                f.write(f"{calls['n']} " + " ".join(repr(b.mixer.lr_mult) for b in self.layers
                                                    if hasattr(b.mixer, "lr_mult")) + "\n")
        if sleep:
            time.sleep(sleep)
        out = fwd(self, input_ids, labels=labels, **kw)
        if calls["n"] in nan_steps:
            out.loss = out.loss * float("nan")
        return out

    LM.forward = forward


def _hook_callbacks():
    path = os.environ.get("TTT_TEST_HOOK_LOG")
    if not path:
        return []
    from ttt_lm.train.loop import Callback
    stop_at = int(os.environ.get("TTT_TEST_STOP_AT", "0"))

    class HookLog(Callback):
        def _log(self, hook, trainer):
            with open(path, "a") as f:
                f.write(f"{hook} {trainer.step}\n")

        def pre_train(self, trainer):
            self._log("pre_train", trainer)

        def pre_step(self, trainer):
            self._log("pre_step", trainer)

        def post_step(self, trainer):
            self._log("post_step", trainer)
            if trainer.step == stop_at:
                trainer.request_stop()

        def post_train(self, trainer):
            self._log("post_train", trainer)

    return [HookLog()]


if __name__ == "__main__":
    from ttt_lm.train import main
    sys.exit(main(sys.argv[1:], data_api=RealData() if os.environ.get("TTT_TEST_REAL_DATA") else SyntheticData,
                  callbacks=_hook_callbacks()))
