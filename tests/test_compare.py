"""`diffexp compare`: summary of a synthetic study directory (sweep.json, trial.json, real TensorBoard events)."""

from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys

import pytest

from diffexp import compare
from tests.fixtures_compare import make_study, write_sweep, write_trial
from tests.helpers import exit_code, markdown_tables, subprocess_env

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    return make_study(tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="module")
def runs(study):
    return compare.load_study_runs(study)


def _row(rows, name):
    return next(r for r in rows if r.case.name == name)


def test_one_row_per_case_in_sweep_order(runs):
    rows = compare.summarize(runs)
    assert [r.case.name for r in rows] == ["Transformer", "DIFF", "DIFF -GroupNorm", "DIFF lambda 0.8"]
    assert [r.case.slug for r in rows] == ["transformer", "diff", "diff-groupnorm", "diff-lambda-0-8"]
    assert [(len(r.complete), len(r.pruned), len(r.missing), r.n_expected) for r in rows] == [
        (3, 0, 0, 3), (2, 1, 0, 3), (1, 0, 2, 3), (0, 0, 3, 3)]
    assert [r.seeds_text for r in rows] == ["3/3", "2/3 (1 pruned)", "1/3 (2 missing)", "0/3 (3 missing)"]


def test_means_and_sample_std(runs):
    rows = compare.summarize(runs)
    t = _row(rows, "Transformer").stats["val/loss"]
    assert t.n == 3
    assert t.mean == pytest.approx(1.92)
    assert t.std == pytest.approx(0.02)  # sample std (ddof=1) of 1.90, 1.92, 1.94
    assert _row(rows, "Transformer").stats["val/loss_ar_hit"].mean == pytest.approx(1.0)
    assert t.format() == "1.920 ± 0.020"
    # a single complete seed: std is n/a, not 0
    g = _row(rows, "DIFF -GroupNorm").stats["val/loss"]
    assert (g.mean, g.std, g.n) == (pytest.approx(1.88), None, 1)
    assert g.format() == "1.880 ± n/a"
    assert _row(rows, "DIFF lambda 0.8").stats["val/loss"].format() == "—"
    transformer = _row(rows, "Transformer")
    assert (transformer.params_total, transformer.params_non_embedding) == (1_000_000, 933_000)
    assert transformer.tokens_per_s == pytest.approx(12_001)


def test_pruned_trial_counted_but_excluded_from_mean(runs):
    diff = _row(compare.summarize(runs), "DIFF")
    assert [t.seed for t in diff.pruned] == [2]
    stat = diff.stats["val/loss"]
    assert stat.n == 2 and stat.mean == pytest.approx(1.86)  # 2.5 of the pruned seed left out
    assert stat.std == pytest.approx(statistics.stdev([1.85, 1.87]))
    assert diff.tokens_per_s == pytest.approx(9_000)  # pruned trial's 1.0 tok/s left out too
    assert any("DIFF, seed 2: pruned at step 200" in line for line in compare.issues(runs, [diff])["pruned"])


def test_objective_comes_from_sweep_json(tmp_path):
    study = tmp_path / "ppl"
    write_sweep(study, [("A", "a"), ("B", "b")], [0], metric="val/ppl", direction="maximize")
    write_trial(study, "A", "a", 0, {"val/loss": 1.0, "val/ppl": 5.0})
    write_trial(study, "B", "b", 0, {"val/loss": 2.0, "val/ppl": 7.0})
    runs = compare.load_study_runs(study)
    assert (runs.objective, runs.direction) == ("val/ppl", "maximize")
    assert runs.metric_names() == ["val/ppl", "val/loss"]
    rows = compare.summarize(runs)
    assert compare.best_case(runs, rows).case.name == "B"
    md = compare.render_markdown(runs, rows, runs.metric_names())
    assert "| Case | Params | Non-emb. params | Valid ppl ↑ | Valid loss |" in md
    assert "**7.000 ± n/a**" in md


def test_curves_merge_resumed_event_files(runs):
    trial = runs.trials[("transformer", 1, 0)]
    assert len(list(trial.path.glob("events.out.tfevents*"))) == 2
    curve = dict(trial.curves["val/loss"])
    assert sorted(curve) == [100, 200, 300, 400]
    assert curve[200] == pytest.approx(2.11)  # logged twice: the resumed run's value wins
    assert curve[400] == pytest.approx(1.92)
    assert trial.curves["params/total"] == [(0, 1_000_000.0)]


def test_main_writes_markdown_csv_and_plots(study, tmp_path, capsys):
    out = tmp_path / "out"
    assert compare.main([str(study), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "1.920 ± 0.020" in printed and "1.860 ± 0.014" in printed and "1.880 ± n/a" in printed
    # objective is the first metric column
    header = next(line for line in printed.splitlines() if "Case" in line)
    assert header.index("Valid loss") < header.index("Valid ppl") < header.index("Train loss")

    md = (out / "compare.md").read_text()
    assert len(markdown_tables(md)) == 1  # drawn by a Markdown renderer
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| Case | Params | Non-emb. params | Valid loss ↓ |")  # the terminal's word too
    assert header.split()[1] == "Case" and "Model" not in printed
    assert [line.split(" | ")[0][2:] for line in table[1:]] == [
        "Transformer", "DIFF", "DIFF -GroupNorm", "DIFF lambda 0.8"]
    assert "| DIFF | 0.99M | 0.92M | **1.860 ± 0.014** |" in md
    assert "| DIFF lambda 0.8 | — | — | — |" in md

    with open(out / "compare.csv", newline="") as f:
        records = list(csv.DictReader(f))
    assert [r["slug"] for r in records] == ["transformer", "diff", "diff-groupnorm", "diff-lambda-0-8"]
    assert float(records[0]["val/loss_mean"]) == pytest.approx(1.92)
    assert float(records[0]["val/loss_std"]) == pytest.approx(0.02)
    assert records[1]["n_complete"] == "2" and records[1]["n_pruned"] == "1" and records[1]["seeds_pruned"] == "2"
    assert records[2]["val/loss_std"] == "" and records[2]["val/loss_n"] == "1"
    assert records[3]["val/loss_mean"] == "" and records[3]["n_missing"] == "3"
    assert json.loads(records[0]["overrides"]) == {"model.arch.attention": "transformer"}

    for name in ("val_loss_curves.png", "objective_bars.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, name
        from matplotlib.image import imread

        image = imread(out / name)
        assert image.shape[0] > 200 and image.shape[1] > 500


def test_partial_study_reports_missing(study, tmp_path, capsys):
    assert compare.main([str(study), "--out", str(tmp_path), "--no-plots"]) == 0
    printed = capsys.readouterr().out
    assert "Missing trials" in printed
    assert ("DIFF -GroupNorm, seed 1: run dir exists, no trial.json (running or crashed); last logged step 250"
            in printed)
    assert "DIFF -GroupNorm, seed 2: not started (no run dir)" in printed
    assert "Cases with no completed seed" in printed and "  - DIFF lambda 0.8" in printed
    assert not list(tmp_path.glob("*.png"))
    md = (tmp_path / "compare.md").read_text()
    assert "## Missing trials (no trial.json)" in md and "- DIFF lambda 0.8, seed 2: not started" in md


def test_default_out_dir_and_metric_filter(tmp_path, capsys):
    study = make_study(tmp_path)
    assert compare.main([str(study), "--metric", "val/ppl", "--no-plots"]) == 0
    out = study / "compare"
    header = (out / "compare.csv").read_text().splitlines()[0]
    assert "val/loss_mean" in header and "val/ppl_mean" in header
    assert "train/loss_mean" not in header and "val/loss_ar_hit_mean" not in header
    # the compare/ folder is not mistaken for a run directory on a second pass
    assert compare.load_study_runs(study).unexpected == []


def test_failed_and_unexpected_trials(tmp_path):
    study = tmp_path / "s"
    write_sweep(study, [("A", "a")], [0, 1])
    write_trial(study, "A", "a", 0, {"val/loss": 1.5})
    write_trial(study, "A", "a", 1, {"val/loss": 9.9}, state="fail")
    write_trial(study, "Old", "old-case", 0, {"val/loss": 1.0})
    runs = compare.load_study_runs(study)
    rows = compare.summarize(runs)
    assert rows[0].stats["val/loss"].values == [1.5] and rows[0].seeds_text == "1/2 (1 failed)"
    found = compare.issues(runs, rows)
    assert found["failed"] == ["A, seed 1: state 'fail'"]
    assert found["unexpected"][0].startswith("old-case/seed0")


def test_search_draws_are_trials_of_their_case(tmp_path, capsys):
    """A search sweep runs n_trials draws per case and seed (seed<k>, seed<k>-draw<d>); compare reads them all."""
    study = tmp_path / "lr"
    write_sweep(study, [("DIFF", "diff")], [0, 1], n_trials=3)
    losses = {(0, 0): 1.9, (0, 1): 1.8, (0, 2): 2.0, (1, 0): 1.7, (1, 1): 2.1}  # seed 1 draw 2 has not run
    for (seed, draw), loss in losses.items():
        write_trial(study, "DIFF", "diff", seed, {"val/loss": loss}, draw=draw)
    runs = compare.load_study_runs(study, curves=False)
    assert runs.unexpected == []
    row = compare.summarize(runs)[0]
    assert (row.n_expected, len(row.complete)) == (6, 5)
    assert row.stats["val/loss"].mean == pytest.approx(statistics.fmean(losses.values()))
    assert compare.issues(runs, [row]) == {"missing": ["DIFF, seed 1 draw 2: not started (no run dir)"]}
    assert compare.main([str(study), "--no-plots"]) == 0
    record = next(csv.DictReader((study / "compare" / "compare.csv").open()))
    assert (record["n_complete"], record["n_missing"]) == ("5", "1")
    assert record["seeds_complete"] == "0;0-draw1;0-draw2;1;1-draw1"


def test_objective_falls_back_to_events(tmp_path):
    study = tmp_path / "s"
    write_sweep(study, [("A", "a")], [0])
    write_trial(study, "A", "a", 0, {"train/loss": 1.0}, curve=[(100, 2.0), (200, 1.7)])
    for curves in (True, False):  # --no-plots still reads the events of a trial.json lacking the objective
        rows = compare.summarize(compare.load_study_runs(study, curves=curves))
        assert rows[0].stats["val/loss"].values == [pytest.approx(1.7)]


def test_events_in_a_nested_version_folder(tmp_path):
    from tests.fixtures_compare import write_events

    write_events(tmp_path / "version_0", {"val/loss": [(100, 2.0), (200, 1.5)]}, walltime=1.0e9)
    write_events(tmp_path, {"val/loss": [(200, 1.4), (300, 1.2)]}, walltime=2.0e9)
    curve = compare.load_curves(tmp_path)["val/loss"]
    assert curve == [(100, 2.0), (200, pytest.approx(1.4)), (300, pytest.approx(1.2))]


def test_bad_dir_exits_2_naming_it(tmp_path, capsys):
    empty = tmp_path / "not-a-study"
    empty.mkdir()
    assert exit_code(["compare", str(empty)]) == 2
    err = capsys.readouterr().err
    assert str(empty) in err and "sweep.json" in err
    assert exit_code(["compare", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err
    (empty / "sweep.json").write_text("{not json")
    assert exit_code(["compare", str(empty)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert exit_code(["compare"]) == 2
    assert "RUNS_DIR" in capsys.readouterr().err


def test_module_entry_point_prints_a_user_error_as_one_paragraph(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "diffexp.compare", str(tmp_path / "nowhere")], env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "nowhere" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_metric_exits_2_listing_available(study, tmp_path, capsys):
    assert exit_code(["compare", str(study), "--out", str(tmp_path), "--metric", "val/accuracy"]) == 2
    err = capsys.readouterr().err
    assert "'val/accuracy'" in err
    for name in ("val/loss", "val/ppl", "train/loss", "val/loss_ar_hit"):
        assert name in err
    assert not (tmp_path / "compare.md").exists()


def test_optuna_storage_input(study, tmp_path, capsys):
    import optuna

    db = tmp_path / "optuna.db"
    url = f"sqlite:///{db}"
    optuna.create_study(study_name="table6", storage=url).set_user_attr("runs_dir", str(study))
    out = tmp_path / "from-storage"
    assert compare.main(["--study", "table6", "--storage", url, "--out", str(out), "--no-plots"]) == 0
    assert "1.920 ± 0.020" in capsys.readouterr().out
    assert (out / "compare.csv").is_file()
    # runs_dir naming the parent runs/ folder works too
    optuna.create_study(study_name="parent", storage=url).set_user_attr("runs_dir", str(study.parent))
    assert compare.runs_dir_from_optuna("table6", url) == study
    assert exit_code(["compare", "--study", "nope", "--storage", url]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and "'table6'" in err
    optuna.create_study(study_name="bare", storage=url)
    assert exit_code(["compare", "--study", "bare", "--storage", url]) == 2
    assert "runs_dir" in capsys.readouterr().err
    assert exit_code(["compare", "--study", "table6", "--storage", str(tmp_path / "missing.db")]) == 2
    assert "missing.db" in capsys.readouterr().err


def test_optuna_journal_storage(study, tmp_path, capsys):
    import optuna

    path = tmp_path / "study.log"
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))
    optuna.create_study(study_name="table6", storage=storage).set_user_attr("runs_dir", str(study))
    assert compare.main(["--study", "table6", "--storage", str(path), "--no-plots", "--out", str(tmp_path)]) == 0
    assert "Transformer" in capsys.readouterr().out


@pytest.mark.parametrize("width", [100, 160])
def test_printed_table_splits_to_fit_the_terminal_and_keeps_every_column(study, tmp_path, width):
    import io

    from rich.console import Console

    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None)
    runs = compare.load_study_runs(study, curves=False)
    compare.compare(study, out=tmp_path, plots=False, console=console)
    printed = buffer.getvalue()
    table_lines = [line for line in printed.splitlines() if line[:1] in "┏┃┡│└"]
    assert table_lines and all(len(line) <= width for line in table_lines)
    assert "…" not in printed  # no squeezed cell or header
    headers = " ".join(line for line in printed.splitlines() if "┃ Case" in line)
    for label in ["Params", "Non-emb.", "Seeds", "Tokens/s"] + [compare.metric_label(m) for m in runs.metric_names()]:
        assert label in headers, label
    # every table repeats the cases; the first holds the objective beside parameters and seeds
    first = printed.split("┃ Case")[1]
    assert first.index("Valid loss ↓") < first.index("Params") < first.index("Seeds")
    tables = printed.count("┃ Case")
    assert printed.count("│ DIFF -GroupNorm ") == tables
    assert tables > 1 if width == 100 else tables == 1


def test_a_study_validated_once_per_trial_is_warned_of_its_one_point_curves(tmp_path, capsys, monkeypatch):
    from matplotlib.container import ErrorbarContainer

    from diffexp.compare import plots

    figures = []
    monkeypatch.setattr(plots, "new_figure", lambda *a, new=plots.new_figure: figures.append(new(*a)) or figures[-1])
    study = tmp_path / "short"
    write_sweep(study, [("Transformer", "transformer"), ("DIFF", "diff")], [0, 1])
    for seed in (0, 1):
        for name, slug, loss in (("Transformer", "transformer", 3.4), ("DIFF", "diff", 3.3)):
            write_trial(study, name, slug, seed, {"val/loss": loss + 0.01 * seed}, global_step=60,
                        curve=[(60, loss + 0.01 * seed)])
    assert compare.main([str(study), "--out", str(tmp_path / "out")]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "warning: val_loss_curves.png has one point per case" in printed
    assert "set a lower trainer.val_check_interval" in printed
    # the figure draws what one point can show: one panel, the step axis from 0, each case's spread over seeds as
    # an error bar (a band needs two steps), and a title that fits inside the figure
    curves = figures[0]
    (ax,) = curves.axes
    assert ax.get_xlim()[0] == 0 and ax.get_xlim()[1] > 60
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 2 and all(c.has_yerr for c in bars)
    renderer = curves.canvas.get_renderer()
    box, title = curves.bbox, ax.title.get_window_extent(renderer)
    assert box.x0 <= title.x0 and title.x1 <= box.x1, (title, box)
    # a study with curves is not warned
    assert compare.main([str(make_study(tmp_path / "full")), "--out", str(tmp_path / "out2")]) == 0
    assert "one point per case" not in capsys.readouterr().out


def test_each_case_keeps_one_colour_in_every_plot(study, tmp_path, monkeypatch):
    """The curves plot leaves out cases with no complete seed, the paired plot the reference; colours follow
    the case, not its position in a plot."""
    from matplotlib.colors import to_rgb

    from diffexp.compare import plots

    figures = []
    real_new_figure = plots.new_figure
    monkeypatch.setattr(plots, "new_figure", lambda *a: figures.append(real_new_figure(*a)) or figures[-1])
    assert compare.main([str(study), "--out", str(tmp_path / "out"), "--reference", "DIFF"]) == 0
    curves, bars, paired = figures
    expected = {name: to_rgb(plots.case_colors(compare.load_study_runs(study))[slug]) for name, slug in
                [("Transformer", "transformer"), ("DIFF", "diff"), ("DIFF -GroupNorm", "diff-groupnorm")]}
    drawn = {line.get_label().split(" (")[0]: to_rgb(line.get_color()) for line in curves.axes[0].get_lines()}
    assert drawn == expected  # three cases with a complete seed, their own colours
    bar_colors = [to_rgb(patch.get_facecolor()) for patch in bars.axes[0].patches]
    assert bar_colors == list(expected.values())  # table order, the case without a seed drawn no bar
    ax = paired.axes[0]
    marks = {label.get_text().split("  (")[0]: y for label, y in zip(ax.get_yticklabels(), ax.get_yticks())}
    checked = set()
    for line in ax.get_lines():
        y = line.get_ydata()
        if len(y) == 1 and line.get_marker() == "o":  # a case's mean difference
            case = next(name for name, mark in marks.items() if mark == y[0])
            assert to_rgb(line.get_color()) == expected[case], case
            checked.add(case)
    assert checked == {"Transformer", "DIFF -GroupNorm"}  # DIFF is the reference here


def test_the_diagnostics_columns_render_as_a_markdown_table(tmp_path):
    """Column labels with a pipe in them ("Max |act|") are escaped like any cell: compare.md's table is drawn, with
    its header's cells in every row."""
    study = tmp_path / "diag"
    write_sweep(study, [("Transformer", "transformer"), ("DIFF | V1", "diff")], [0, 1])
    for slug, name, base in (("transformer", "Transformer", 1.9), ("diff", "DIFF | V1", 1.8)):
        for seed in (0, 1):
            write_trial(study, name, slug, seed, {"val/loss": base + 0.01 * seed, "vitals/act_max_abs": 12.5 + seed,
                                                  "vitals/attn_logit_max": 7.0, "vitals/grad_spikes": 1.0})
    assert compare.main([str(study), "--out", str(tmp_path / "out"), "--no-plots"]) == 0
    header, *rows = markdown_tables((tmp_path / "out" / "compare.md").read_text())[0]
    assert {"Max |act|", "Max attn logit", "Grad spikes"} <= set(header)
    assert [row[0] for row in rows] == ["Transformer", "DIFF | V1"]
    assert rows[1][header.index("Max |act|")] == "13.000 ± 0.707"


def test_a_metric_at_several_bit_widths_is_drawn_against_the_width(tmp_path):
    """quantize/loss_b16 ... _b4 (diffexp eval quantize): compare writes bit_widths.png, one line per case."""
    import io

    from rich.console import Console

    from diffexp.compare import compare as run_compare
    from diffexp.compare.plots import bit_width_families

    study = tmp_path / "bits"
    write_sweep(study, [("Transformer", "transformer"), ("DIFF", "diff")], [0, 1])
    for slug, name, worse in (("transformer", "Transformer", 1.0), ("diff", "DIFF", 0.2)):
        for seed in (0, 1):
            write_trial(study, name, slug, seed, {"val/loss": 2.0, **{f"quantize/loss_b{bits}": 2.0 + worse / bits
                                                                      for bits in (16, 8, 6, 4)}})
    rows = run_compare(study, out=tmp_path / "out", console=Console(file=io.StringIO(), width=200))
    assert [bits for bits, _ in bit_width_families(rows)["quantize/loss"]] == [16, 8, 6, 4]
    assert (tmp_path / "out" / "bit_widths.png").stat().st_size > 10_000


def test_small_metrics_keep_their_significant_digits(tmp_path, capsys):
    """A rounding error (~1e-3 .. 1e-6) reads in significant digits in the main table, not as '0.002 ± 0.000',
    while the loss beside it keeps three decimals and compare.csv keeps the full values."""
    study = tmp_path / "small"
    write_sweep(study, [("Transformer", "transformer")], [0, 1, 2])
    errors, biases = [0.00209, 0.00213, 0.00217], [-2e-6, -3e-6, -4e-6]
    for seed in (0, 1, 2):
        write_trial(study, "Transformer", "transformer", seed,
                    {"val/loss": 1.90 + 0.02 * seed, "rounding/bf16_rel_error": errors[seed],
                     "rounding/bf16_bias": biases[seed]})
    assert compare.main([str(study), "--out", str(tmp_path / "out"), "--no-plots"]) == 0
    printed = capsys.readouterr().out
    header, row = markdown_tables((tmp_path / "out" / "compare.md").read_text())[0]
    cells = dict(zip(header, row))
    assert cells["Valid loss ↓"] == "**1.920 ± 0.020**"
    assert cells["rounding/bf16_rel_error"] == "0.00213 ± 0.00004"
    assert cells["rounding/bf16_bias"] == "-3.00e-06 ± 1.00e-06"
    assert "0.00213 ± 0.00004" in printed and "-3.00e-06 ± 1.00e-06" in printed
    with open(tmp_path / "out" / "compare.csv", newline="") as f:
        record = next(csv.DictReader(f))
    assert float(record["rounding/bf16_rel_error_mean"]) == pytest.approx(statistics.mean(errors), rel=1e-12)
    assert float(record["rounding/bf16_bias_std"]) == pytest.approx(statistics.stdev(biases), rel=1e-12)
