"""The model as Hugging Face transformers sees it: `diffexp export --format hf` and `model.init_from` an HF directory.

`classes.py`: the transformers classes a variant's registry entry may name (`Variant.hf_architecture`), each with
its config and weight layout; `llama.py`: `LlamaForCausalLM` (and the names every Llama-shaped layout shares);
`diff_llama.py`: `DiffLlamaForCausalLM`, and the DIFF V1 settings it cannot compute; `remote_code.py`: any
variant as remote code built from diffexp's own model source (`remote/` holds the wrapper it ships);
`tokenizer.py`: the tokenizer files `AutoTokenizer` reads; `reading.py`: an HF Llama or DiffLlama directory back
as a diffexp checkpoint.
transformers is an optional extra (`pip install 'diffexp[hf]'`), imported only here and only when needed.
"""

from __future__ import annotations

from diffexp.errors import UserError


def require_transformers(key: str) -> None:
    """A UserError naming `key` when transformers is not installed."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UserError(f"{key} needs the transformers package, which is not installed: pip install "
                        "'diffexp[hf]'") from None
