"""The config of a diffexp model as a transformers model (`diffexp export --format hf --remote-code`).

`arch` holds diffexp's `model.arch` settings, every flag of the variant; the other fields are the names
transformers and the tools around it (lm_eval, serving) read.
"""

from transformers import PretrainedConfig


class DiffexpConfig(PretrainedConfig):
    model_type = "diffexp"

    def __init__(self, arch: dict | None = None, **kwargs) -> None:
        self.arch = dict(arch or {})
        if self.arch:
            kwargs.setdefault("vocab_size", self.arch["vocab_size"])
            kwargs.setdefault("hidden_size", self.arch["d_model"])
            kwargs.setdefault("num_hidden_layers", self.arch["n_layers"])
            kwargs.setdefault("num_attention_heads", self.arch["n_heads"])
            kwargs.setdefault("max_position_embeddings", self.arch["max_seq_len"])
            kwargs.setdefault("tie_word_embeddings", self.arch["tie_embeddings"])
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings"):
            setattr(self, name, kwargs.pop(name, None))
        super().__init__(**kwargs)
