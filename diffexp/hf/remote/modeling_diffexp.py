"""A diffexp model as a transformers model, written by `diffexp export --format hf --remote-code`.

The network is diffexp's own model code, carried in BUNDLE (its files, with diffexp's imports made relative) and
unpacked beside this file on first use: loading needs torch and transformers, not diffexp. Attention runs in
PyTorch ops (no compiled CPU kernel, no Triton); decoding keeps diffexp's own cache between generate's steps.
"""

import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_diffexp import DiffexpConfig

#: diffexp's model source: path inside the package -> text (filled in by diffexp export)
BUNDLE: dict[str, str] = {}
#: the output field generate reads the cache from (renamed from past_key_values in transformers 5.x)
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _unpack(name: str) -> Path:
    """BUNDLE as a package directory `name`, beside this file (or in the temp directory when that is read-only);
    written aside and renamed into place, so concurrent loads never see half of it."""
    for base in (Path(__file__).resolve().parent, Path(tempfile.gettempdir())):
        target = base / name
        if (target / "__init__.py").is_file():
            return target
        staging = base / f".{name}.{os.getpid()}.tmp"
        try:
            for relative, source in BUNDLE.items():
                path = staging / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(source, encoding="utf-8")
            os.replace(staging, target)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if (target / "__init__.py").is_file():  # another process unpacked it first
                return target
            continue
        return target
    raise OSError(f"cannot unpack the model code of {__file__}: no writable directory")


def bundle_module(module: str):
    """A module of the bundled diffexp package, e.g. "model.decoder", imported on first use."""
    digest = hashlib.sha256(repr(sorted(BUNDLE.items())).encode()).hexdigest()[:16]
    name = f"_diffexp_model_{digest}"
    if name not in sys.modules:
        root = _unpack(name)
        spec = importlib.util.spec_from_file_location(name, root / "__init__.py",
                                                      submodule_search_locations=[str(root)])
        package = importlib.util.module_from_spec(spec)
        sys.modules[name] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"{name}.{module}")


class DiffexpCache:
    """diffexp's decoding cache (keys, values and DINT's running sums of every layer) as generate carries it."""

    is_compileable = False

    def __init__(self, decoder_cache) -> None:
        self.decoder_cache = decoder_cache

    @property
    def is_linear(self) -> list[bool]:
        return [False]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.decoder_cache.length


class DiffexpForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = DiffexpConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderBlock"]

    def __init__(self, config: DiffexpConfig) -> None:
        super().__init__(config)
        arch = bundle_module("model.config").ModelConfig(**config.arch)
        self.model = bundle_module("model.decoder").Decoder(arch)
        if arch.tie_embeddings:
            self._tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own cache (DiffexpCache) on the first step

    def _init_weights(self, module) -> None:
        """Parameters come from the weights file; RoPE's tables are derived, so they are rebuilt here."""
        if type(module).__name__ == "RotaryEmbedding":
            positions, head_dim = module.cos.shape
            fresh = type(module)(head_dim, positions, float(self.config.arch["rope_theta"]))
            with torch.no_grad():
                for name, table in fresh.named_buffers():
                    setattr(module, name, table.to(getattr(module, name).device))

    def get_input_embeddings(self):
        return self.model.embed

    def get_output_embeddings(self):
        return self.model.lm_head

    def forward(self, input_ids=None, attention_mask=None, cache=None, past_key_values=None, use_cache=None,
                labels=None, return_dict=None, **kwargs):
        state = cache if cache is not None else past_key_values
        if not isinstance(state, DiffexpCache):  # generate may hand over an empty cache of its own kind
            state = None
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("this model reads every position: pass rows without padding (attention_mask all ones)")
        if state is None and use_cache:
            state = DiffexpCache(self.model.new_cache())
        logits = self.model(input_ids, cache=None if state is None else state.decoder_cache)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: state})

    def prepare_inputs_for_generation(self, input_ids, cache=None, past_key_values=None, attention_mask=None,
                                      use_cache=True, **kwargs):
        state = cache if cache is not None else past_key_values
        if isinstance(state, DiffexpCache):
            input_ids = input_ids[:, state.get_seq_length():]  # only the tokens the cache has not seen
        else:
            state = None
        return {"input_ids": input_ids, CACHE_FIELD: state, "attention_mask": attention_mask, "use_cache": use_cache}
