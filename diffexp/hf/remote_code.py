"""Any variant, any flag, as transformers remote code: configuration_diffexp.py, modeling_diffexp.py and auto_map.

modeling_diffexp.py is the wrapper in `remote/` with diffexp's model package (errors.py, model/ and the kernel
door, kernels/registry.py) filled into its BUNDLE at export time, each `from diffexp.x import y` made relative to
the bundle. The exported model therefore runs the very code diffexp trains with, on its plain path: the bundle
registers no fast kernel, so it ships the math only.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # the diffexp package directory
WRAPPER = Path(__file__).with_name("remote")
CONFIG_FILE, MODELING_FILE = "configuration_diffexp.py", "modeling_diffexp.py"
MODEL_TYPE = "diffexp"  # config.json's model_type: DiffexpConfig's
AUTO_MAP = {"AutoConfig": "configuration_diffexp.DiffexpConfig",
            "AutoModelForCausalLM": "modeling_diffexp.DiffexpForCausalLM"}
_ABSOLUTE = re.compile(r"^(\s*)from (diffexp(?:\.\w+)*) import ", re.MULTILINE)
_BUNDLE_LINE = "BUNDLE: dict[str, str] = {}"


def _relative(source: str, relative_path: str) -> str:
    """`source` (diffexp/<relative_path>) with each `from diffexp.x import` relative to its own package."""
    parts = ["diffexp", *relative_path.removesuffix(".py").split("/")]
    package = parts[:-1]  # a module's package; a package's __init__ is in the package itself
    if re.search(r"^\s*import diffexp", source, re.MULTILINE):
        raise ValueError(f"{relative_path}: `import diffexp...` cannot be bundled; use `from diffexp.x import y`")

    def rewrite(match: re.Match) -> str:
        target = match.group(2).split(".")
        common = 0
        while common < min(len(package), len(target)) and package[common] == target[common]:
            common += 1
        return f"{match.group(1)}from {'.' * (len(package) - common + 1)}{'.'.join(target[common:])} import "

    return _ABSOLUTE.sub(rewrite, source)


def bundle_sources() -> dict[str, str]:
    """diffexp's model package as BUNDLE holds it: path inside the package -> source with relative imports."""
    files = [PACKAGE / "errors.py", PACKAGE / "kernels" / "registry.py", *sorted((PACKAGE / "model").rglob("*.py"))]
    sources = {"__init__.py": '"""diffexp\'s model code, bundled by `diffexp export --remote-code`."""\n',
               "kernels/__init__.py": '"""The kernel door alone: no fast kernel is registered here."""\n'}
    for path in files:
        relative = path.relative_to(PACKAGE).as_posix()
        sources[relative] = _relative(path.read_text(encoding="utf-8"), relative)
    return sources


def modeling_source() -> str:
    """modeling_diffexp.py with BUNDLE filled in."""
    template = (WRAPPER / MODELING_FILE).read_text(encoding="utf-8")
    if template.count(_BUNDLE_LINE) != 1:
        raise ValueError(f"{MODELING_FILE} must hold the line {_BUNDLE_LINE!r} once")
    entries = "".join(f"    {path!r}: {source!r},\n" for path, source in bundle_sources().items())
    return template.replace(_BUNDLE_LINE, "BUNDLE: dict[str, str] = {\n" + entries + "}")


def remote_config(arch: dict, eos_id: int | None) -> dict:
    """config.json: diffexp's arch (attention on the PyTorch backend: the bundle has no other) and the fields
    transformers reads."""
    arch = {**arch, "backend": "sdpa"}
    return {"model_type": MODEL_TYPE, "architectures": ["DiffexpForCausalLM"], "auto_map": AUTO_MAP, "arch": arch,
            "vocab_size": arch["vocab_size"], "hidden_size": arch["d_model"], "num_hidden_layers": arch["n_layers"],
            "num_attention_heads": arch["n_heads"], "max_position_embeddings": arch["max_seq_len"],
            "tie_word_embeddings": arch["tie_embeddings"], "eos_token_id": eos_id, "bos_token_id": None,
            "pad_token_id": None, "dtype": "float32"}


def write_remote_code(out: Path, arch: dict, eos_id: int | None) -> None:
    """The two code files and config.json into `out` (the weights keep DiffexpLM's names: model.<Decoder's>)."""
    shutil.copyfile(WRAPPER / CONFIG_FILE, out / CONFIG_FILE)
    (out / MODELING_FILE).write_text(modeling_source(), encoding="utf-8")
    (out / "config.json").write_text(json.dumps(remote_config(arch, eos_id), indent=2) + "\n", encoding="utf-8")
