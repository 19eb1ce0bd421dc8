"""One file per evaluation. Each registers its `Evaluation` entry (diffexp.evals.registry); this package
imports every module in its folder, so a new evaluation is one new file here and its test.

Importing an entry must stay light: the command lists every entry for `diffexp eval --help`. An entry file
imports torch if it must, never Lightning; its scoring code is imported inside its functions.
"""

import importlib
import pkgutil


def _import_entries() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_import_entries()
