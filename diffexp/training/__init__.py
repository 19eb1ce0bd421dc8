from diffexp.training.module import DiffexpLM, OptimConfig

__all__ = ["DiffexpLM", "OptimConfig"]
