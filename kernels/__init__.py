"""Sequence-mixing ops: one folder per op, each with ``reference.py`` (sequential PyTorch, the
specification), a PyTorch chunked form, a Triton ``chunk.py`` (forward and backward) and one
public function in its ``__init__.py`` that dispatches on ``backend`` ("torch" | "triton").
This package imports only torch and triton, never ttt_lm."""
