from ttt_lm.model.config import ModelConfig
from ttt_lm.model.lm import LM, LMOutput, build_model

__all__ = ["ModelConfig", "LM", "LMOutput", "build_model"]
