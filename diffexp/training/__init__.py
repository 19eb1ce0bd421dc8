"""Training: DiffexpLM and what a fit needs. DiffexpLM and OptimConfig load on first use, so that the light
subcommands (generate, export, eval --help, compare) reach `diffexp.training.loading` and the other plain modules
of this package without importing Lightning."""

__all__ = ["DiffexpLM", "OptimConfig"]


def __getattr__(name: str):
    if name in __all__:
        from diffexp.training import module

        return getattr(module, name)
    raise AttributeError(f"module 'diffexp.training' has no attribute {name!r}")
