"""`python -m diffexp.bench.summary DIR [OUT.md]`: one markdown page of every bench result in DIR (bench/gpu.sh's
results).

Each `diffexp bench train` JSON becomes its table (the same rows the run printed), the probe its two tables, a
fit's JSON its tokens/s beside the bench step of the same model, and a step that failed its line from
`failed.txt`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def train_section(data: dict, name: str) -> str:
    from diffexp.bench.train_step import table

    title, headers, rows, caption = table(data)
    complete = "" if data.get("complete", True) else " (stopped part-way: the rounds it finished)"
    return f"### {name}: {title}{complete}\n\n`{data['command']}`\n\n{markdown_table(headers, rows)}\n\n{caption}\n"


def fit_section(fit: dict, bench: dict | None) -> str:
    lines = [f"### diffexp fit: {fit['command']}", "",
             f"- tokens/s (median of the logged {TOKENS_TAG} after the first {fit['skipped']} logs): "
             f"{fit['tokens_per_s']:,.0f} over {fit['logs']} logs"]
    if bench is not None:
        entry = next((e for e in bench["results"].values() if e["variant"] == fit["variant"]), None)
        if entry is not None:
            lines.append(f"- the bench step of the same model ({bench['command']}): {entry['tokens_per_s']:,.0f} "
                         f"tokens/s; fit / bench step = {fit['tokens_per_s'] / entry['tokens_per_s']:.3f}")
    return "\n".join(lines) + "\n"


def joined_section(paths: list[Path]) -> str:
    """One table of the runs that each measured one variant against the reference (bench/gpu.sh's
    train-compiled-<variant>.json): the reference's row from the first, each variant's row from its own run, its
    ratios to the reference measured in that run."""
    from diffexp.bench.train_step import table

    runs = []
    for path in paths:
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if not runs:
        return ""
    first = runs[0]
    reference = first["config"]["variants"][0]
    variants, results = [reference], {}
    for run in runs:
        for key, entry in run["results"].items():
            if entry["variant"] == reference and run is not first:
                continue
            results[key] = entry
            if entry["variant"] not in variants:
                variants.append(entry["variant"])
    data = {**first, "config": {**first["config"], "variants": variants}, "results": results}
    title, headers, rows, caption = table(data)
    partial = [p.stem for p, run in zip(paths, runs) if run.get("complete") is False]
    note = f" Stopped part-way (the rounds they finished): {', '.join(partial)}." if partial else ""
    return (f"### compiled, every variant: {title}\n\n{markdown_table(headers, rows)}\n\n{caption} Each variant's "
            f"row is from its own run beside {reference} (the {reference} row: the first run's).{note}\n")


def summarise(folder: Path, failed: Path | None = None) -> str:
    """The page: the steps that did not finish (`failed`, default DIR/failed.txt), then every table."""
    parts = [f"# bench/gpu.sh results: {folder.name}\n"]
    failed = failed or folder / "failed.txt"
    if failed.is_file() and failed.read_text().strip():
        parts.append("## Steps that did not finish\n\n" + "\n".join(f"- {line}" for line in
                                                                   failed.read_text().splitlines()) + "\n")
    probe = folder / "probe.json"
    if probe.is_file():
        from diffexp.bench.probe import markdown

        parts.append(markdown(json.loads(probe.read_text())))
    compiled = sorted(folder.glob("train-compiled-*.json"))
    if len(compiled) > 1:
        parts.append(joined_section(compiled))
    for path in sorted(folder.glob("train-*.json")):
        try:
            parts.append(train_section(json.loads(path.read_text()), path.stem))
        except (KeyError, ValueError, TypeError) as err:
            parts.append(f"### {path.stem}: unreadable ({type(err).__name__}: {err})\n")
    fit = folder / "fit.json"
    if fit.is_file():  # beside the bench step of the same model: compiled, as the recipe trains
        fit_data = json.loads(fit.read_text())
        benches = [json.loads(p.read_text()) for p in sorted(folder.glob("train-compiled*.json"))]
        bench = next((b for b in benches if any(e["variant"] == fit_data["variant"] for e in b["results"].values())),
                     None)
        parts.append(fit_section(fit_data, bench))
    return "\n".join(parts)


TOKENS_TAG = "vitals/throughput/tokens_per_s"


def fit_throughput(run_dir: Path, command: str, variant: str, skip: int = 2) -> dict:
    """The logged tokens/s of a fit's TensorBoard events under run_dir (the first `skip` logs, which hold the first
    steps' one-time costs, left out): TOKENS_TAG, or train/tokens_per_s in fits from before it moved there."""
    import statistics

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = []
    for events in sorted(run_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        tag = next((t for t in (TOKENS_TAG, "train/tokens_per_s") if t in acc.Tags().get("scalars", [])), None)
        values += [s.value for s in acc.Scalars(tag)] if tag else []
    kept = values[skip:] or values
    if not kept:
        raise SystemExit(f"no {TOKENS_TAG} logged under {run_dir}")
    return {"command": command, "variant": variant, "logs": len(kept), "skipped": len(values) - len(kept),
            "tokens_per_s": statistics.median(kept)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["fit"]:  # fit RUN_DIR OUT_JSON VARIANT COMMAND...
        run_dir, out, variant, command = Path(argv[1]), Path(argv[2]), argv[3], " ".join(argv[4:])
        out.write_text(json.dumps(fit_throughput(run_dir, command, variant), indent=1))
        return 0
    folder = Path(argv[0])  # DIR [OUT.md]: every result in DIR, into OUT.md (default DIR/summary.md)
    target = Path(argv[1]) if len(argv) > 1 else folder / "summary.md"
    text = summarise(folder, failed=target.parent / "failed.txt")
    partial = target.with_name(f".{target.name}.partial")
    partial.write_text(text)
    partial.replace(target)  # replaced whole
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
