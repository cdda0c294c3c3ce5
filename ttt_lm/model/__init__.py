from ttt_lm.model.config import ModelConfig
from ttt_lm.model.lm import LM, LMOutput, build_model
from ttt_lm.model import e2e as _e2e  # noqa: F401  the TTT-E2E variant LM(cfg) builds (model.ttt_e2e)

__all__ = ["ModelConfig", "LM", "LMOutput", "build_model"]
