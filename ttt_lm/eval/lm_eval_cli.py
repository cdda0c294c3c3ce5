"""lm-evaluation-harness's own command line with the ``ttt_lm`` model registered:

    python -m ttt_lm.eval.lm_eval_cli --model ttt_lm --model_args checkpoint=out/tiny \\
        --include_path ttt_lm/eval/tasks --tasks ttt_tiny --batch_size 8 --log_samples --output_path results

takes exactly ``lm_eval``'s arguments (``lm_eval --help``). lm_eval 0.4.13 offers no way to add a
model to its CLI from another package (models enter its registry by being imported; it reads no
entry points and ``--include_path`` covers tasks only), so this module imports
:mod:`ttt_lm.eval.lm_eval_adapter`, which registers the model, and then calls lm_eval's
``cli_evaluate``. Errors of ours (a checkpoint, a tokenizer) and a task dataset that cannot be
loaded (offline, or a missing local file) end with one ``error: …`` line and exit code 2 instead of
a traceback.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    import ttt_lm.eval.lm_eval_adapter as adapter  # registers "ttt_lm"
    from lm_eval.__main__ import cli_evaluate

    from ttt_lm.config import ConfigError
    from ttt_lm.data import DataError
    from ttt_lm.data.tokenizer import TokenizerError
    from ttt_lm.eval.common import EvalError
    if argv is not None:
        sys.argv = ["lm_eval", *argv]
    try:
        cli_evaluate()
    except (EvalError, DataError, TokenizerError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - only a dataset failure is rephrased, anything else re-raised
        msg = adapter.dataset_error(e)
        if msg is None:
            raise
        print(f"error: {msg}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
