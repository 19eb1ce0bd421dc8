"""`diffexp compare --study NAME`: find a study's run directory through its Optuna storage.

Opening the storage and its error messages are diffexp.sweep.storage's; every URL shown is masked
there (diffexp.secrets), so no password reaches the terminal from here.
"""

from __future__ import annotations

from pathlib import Path

from diffexp.compare.errors import CompareError
from diffexp.sweep.layout import SWEEP_FILE


def runs_dir_from_optuna(study_name: str, storage: str, origin: str = "--storage") -> Path:
    """The study run directory recorded in the Optuna study's user attribute "runs_dir".

    A relative runs_dir is taken from the current directory, else from the storage file's directory;
    if it names the parent (runs/) rather than runs/<study>/, runs/<study_name>/ is used.
    `origin` says where the URL came from (--storage or DIFFEXP_STORAGE), for messages; they show it masked.
    """
    import optuna  # only --study needs it: a plain RUNS_DIR compare starts faster without

    from diffexp.sweep.storage import describe, failure, journal_path, open_storage, sqlite_path

    where = describe(storage, origin)
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        handle = open_storage(storage, origin, create=False)
        try:
            study = optuna.load_study(study_name=study_name, storage=handle)
        except KeyError:
            names = optuna.get_all_study_names(storage=handle)
            have = ", ".join(map(repr, names)) if names else "none"
            raise CompareError(f"--study {study_name!r} not found in {where} (studies there: {have})") from None
        except Exception as exc:  # connection lost, permission denied, ...: never echo the password
            raise failure(storage, where, exc, doing="cannot read the study") from None
    finally:
        optuna.logging.set_verbosity(verbosity)
    runs_dir = study.user_attrs.get("runs_dir")
    if not runs_dir:
        raise CompareError(f"Optuna study {study_name!r} in {where} has no user attribute 'runs_dir' "
                           "(the sweep runner sets it to the study's run directory)")
    candidates = [Path(runs_dir)]
    storage_file = sqlite_path(storage) or journal_path(storage)
    if not Path(runs_dir).is_absolute() and storage_file is not None:
        candidates.append(storage_file.resolve().parent / runs_dir)
    for base in candidates:
        for path in (base, base / study_name):
            if (path / SWEEP_FILE).is_file():
                return path
    return candidates[0]  # load_study_runs explains what is missing there
