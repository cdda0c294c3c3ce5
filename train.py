"""Pretrain a language model.

    python train.py                                   # configs/tiny.yaml: tiny hybrid, bundled corpus, CPU
    python train.py configs/x.yaml optim.lr=3e-4      # a preset plus dotted overrides
    torchrun --nproc_per_node 8 train.py configs/x.yaml
    deepspeed --num_gpus 8 train.py configs/x.yaml
    srun python train.py configs/x.yaml               # with MASTER_ADDR / MASTER_PORT exported
    python train.py --help [SECTION]                  # the config's keys, types and defaults
    python train.py --print-config configs/x.yaml optim.lr=3e-4   # the resolved config, then exit

Exit status 0 when done, ttt_lm.train.PREEMPTED_EXIT_CODE after SIGTERM/SIGUSR1 (checkpoint saved),
2 for a config or command line refused before any work, 1 for any other error (a refused resume,
data that cannot be read, non-finite losses).
"""
import os
import sys

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "tiny.yaml")

USAGE = f"""usage: python train.py [config.yaml] [dotted.key=value ...]
       python train.py --print-config [config.yaml] [dotted.key=value ...]
       python train.py --help [SECTION]

  Trains the preset config.yaml (default {os.path.relpath(DEFAULT_CONFIG)}: the tiny hybrid on the
  bundled corpus, CPU) with the overrides applied in order, e.g. optim.lr=3e-4 train.max_steps=1000.
  --print-config prints the resolved config (preset, then overrides) as YAML and exits.
  --help SECTION lists one section's keys in full (e.g. optim, model.ttt).
  Exit status: 0 done, 2 a config or command line refused before any work, 1 any other error.
  Docs: docs/training.md (training, resuming), docs/models.md (presets and model keys)."""


def cli(argv):
    """``--help`` and ``--print-config``, which need no run: their exit status. None for a training
    command line, which is left to ``ttt_lm.train.main`` untouched (nothing is imported before it
    installs its preemption handler)."""
    argv = [a for a in argv if not a.startswith("--local_rank")]  # the deepspeed launcher's
    bad = [a for a in argv if a.startswith("-") and a not in ("-h", "--help", "--print-config")]
    if bad:
        print(f"error: unknown option {bad[0]!r} (train.py takes a config path and key=value overrides; "
              f"see python train.py --help)", file=sys.stderr)
        return 2
    helps = [i for i, a in enumerate(argv) if a in ("-h", "--help")]
    if not helps and (not argv or argv[0] != "--print-config"):
        return None
    from ttt_lm.config import ConfigError, describe_config, load_config, to_yaml
    try:
        if helps:  # --help [SECTION]; anywhere on the line, as argparse takes it
            after = argv[helps[0] + 1:helps[0] + 2] if helps[0] == 0 else []
            if helps[0] == 0 and len(argv) > 2:
                raise ConfigError(f"--help takes at most one section, got {argv[1:]}")
            keys = describe_config(after[0] if after else None)
            print(USAGE + "\n\nconfig keys (type = schema default; a preset sets its own):\n" + keys)
            return 0
        rest = argv[1:]
        if "--print-config" in rest:
            raise ConfigError("--print-config is given twice")
        path = rest.pop(0) if rest and "=" not in rest[0] else DEFAULT_CONFIG
        print(to_yaml(load_config(path, rest)), end="")
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    rc = cli(sys.argv[1:])
    if rc is not None:
        sys.exit(rc)
    from ttt_lm.train import main
    sys.exit(main())
