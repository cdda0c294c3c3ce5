"""Evaluations of trained checkpoints and of layer kinds on synthetic tasks.

``python -m ttt_lm.eval <task> ...`` with task perplexity, long_context, passkey, synthetic or
lm_eval, and passkey_train, which fine-tunes a checkpoint on passkey prompts (see
``python -m ttt_lm.eval <task> --help``). Evals import the model and the data package, never the
trainer's internals; the lm-evaluation-harness adapter lives in ``ttt_lm.eval.lm_eval_adapter``
(imported on demand: it needs the ``lm_eval`` package).
"""
from ttt_lm.eval.checkpoint import Checkpoint, load_checkpoint, load_model, save_export
from ttt_lm.eval.common import EvalError, check_context, token_byte_lengths
from ttt_lm.eval.long_context import loss_by_position, summarize
from ttt_lm.eval.passkey import build_prompt, passkey_grid, practice_finetune
from ttt_lm.eval.perplexity import evaluate_perplexity
from ttt_lm.eval.synthetic import induction_heads, mqar, run_synthetic, selective_copying

__all__ = [
    "Checkpoint", "EvalError", "build_prompt", "check_context", "evaluate_perplexity", "induction_heads",
    "load_checkpoint", "load_model", "loss_by_position", "mqar", "passkey_grid", "practice_finetune", "run_synthetic",
    "save_export", "selective_copying", "summarize", "token_byte_lengths",
]
