"""`diffexp bench train|decode|kernel [options]`: the cost of each attention variant relative to the reference.

Every kind measures all variants side by side in one run, writes a results JSON, prints a table and, with
`--compare OLD.json`, how the ratios changed; every flag is checked before any model is built.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import sys

from diffexp.bench import options, report
from diffexp.errors import UserError, guarded

#: kind -> its module; each has NAME, ABOUT, LAYOUT, build_parser, validate, config, run(args, save_finished) and
#: table (and may have plot(data, json_path) -> the figure's path)
KINDS = {"train": "diffexp.bench.train_step", "decode": "diffexp.bench.decode", "kernel": "diffexp.bench.kernel"}
DEFAULT_KIND = "train"


def kind_module(kind: str):
    return importlib.import_module(KINDS[kind])


def declared(module: str, *names: str) -> tuple:
    """The string constants `names` a bench module declares (its NAME and ABOUT), read from its source without
    importing it: `diffexp bench --help` stays light (the kinds import the model, the trainer and Lightning)."""
    import ast
    import importlib.util

    tree = ast.parse(open(importlib.util.find_spec(module).origin).read())
    values = {target.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
              for target in node.targets if isinstance(target, ast.Name) and target.id in names}
    return tuple(values[name] for name in names)


def usage() -> str:
    others = [declared(f"diffexp.bench.{module}", "NAME", "ABOUT") for module in ("trainer", "data", "probe")]
    width = max(len(name) for name in [*KINDS, *(name for name, _ in others)])
    lines = ["usage: diffexp bench [KIND] [options]", "",
             "Cost of each registered attention variant relative to the reference variant, measured side by side",
             f"in one run. With no KIND (or options first) the kind is {DEFAULT_KIND}.", "", "kinds:"]
    lines += [f"  {kind:<{width}}  {declared(KINDS[kind], 'ABOUT')[0]}" for kind in KINDS]
    lines += [f"  {name:<{width}}  {about}" for name, about in others]
    lines += ["", "`diffexp bench KIND --help` lists the options of a kind."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """0 on success; a bad flag raises UserError before any work (diffexp.cli prints it and exits 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"], ["help"]):
        sys.stdout.write(usage())
        return 0
    if not argv or argv[0].startswith("-"):
        return run_kind(kind_module(DEFAULT_KIND), argv)
    if argv[0] == "trainer":  # not per variant: its own flags (diffexp.bench.trainer)
        from diffexp.bench.trainer import main as trainer_main

        return trainer_main(argv[1:])
    if argv[0] == "probe":  # one attention layer's SDPA backends and formulations (diffexp.bench.probe)
        from diffexp.bench.probe import main as probe_main

        return probe_main(argv[1:])
    if argv[0] == "data":  # the data preparation, not the model (diffexp.bench.data)
        from diffexp.bench.data import main as data_main

        return data_main(argv[1:])
    if argv[0] not in KINDS:
        kinds = ", ".join([*KINDS, "trainer", "data", "probe"])
        raise UserError(f"diffexp bench KIND: got {argv[0]!r}; expected one of {kinds} "
                        "(`diffexp bench --help` describes them)")
    return run_kind(kind_module(argv[0]), argv[1:])


def run_kind(kind, argv: list[str]) -> int:
    """Parse and check every flag, measure, write the JSON, print the table (and the comparison)."""
    args = kind.build_parser().parse_args(argv)
    options.validate(args)
    kind.validate(args)
    old = None if args.compare is None else report.load_results(args.compare, kind.NAME)
    options.output_path(args, kind.NAME)
    header = {"kind": kind.NAME, "created": _dt.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(["diffexp", "bench", kind.NAME, *argv]), "config": kind.config(args)}

    unwritten: list[OSError] = []
    start_env: dict = {}

    def save_finished(results: dict) -> None:
        """The results so far (a kind saves them as they are measured): a run stopped later keeps them. A file that
        cannot be written (a full disk) is said once; the measuring goes on."""
        try:
            report.write_results(args.json, {**header, "complete": False, "env": start_env, "results": results})
        except OSError as err:
            if not unwritten:
                print(f"warning: --json {args.json}: cannot write the results so far ({err}); measuring on",
                      file=sys.stderr, flush=True)
            unwritten.append(err)

    env, results = report.recorded_run(args.device, args.threads, lambda: kind.run(args, save_finished),
                                       on_start=start_env.update)
    data = {**header, "env": env, "results": results}
    try:
        report.write_results(args.json, data)
        unwritten.clear()
    except OSError as err:  # the table is still printed below, then the error
        unwritten[:] = [err]
    title, headers, rows, caption = kind.table(data)
    caption += f" Wall time {env['wall_s']:.0f} s. Results: " + ("not written (below)" if unwritten else str(args.json))
    if hasattr(kind, "plot") and not unwritten:  # a kind with a figure writes it beside the JSON
        caption += f", plot: {kind.plot(data, args.json)}"
    caption += report.load_note(env)
    report.print_table(title, headers, rows, caption, group_columns=tuple(range(1, len(kind.LAYOUT.labels))))
    report.print_profiles(data, kind.LAYOUT.labels)
    if old is not None:
        report.compare(old, data, kind.LAYOUT, args.compare)
    if unwritten:
        raise UserError(f"--json {args.json}: cannot write the results: {unwritten[0]}; the table above is all "
                        "this run kept")
    return 0


if __name__ == "__main__":  # `python -m diffexp.bench.cli` bypasses diffexp.cli and its guard: guarded once here
    sys.exit(guarded(main))
