"""Every `diffexp fit` is a row of TensorBoard's HParams tab (diffexp.training.hparams), read back the way
TensorBoard reads it: its event files, and its hparams plugin's own experiment and session-group handlers."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from diffexp.cli import main
from diffexp.model import Decoder
from diffexp.model.attention.registry import variant
from diffexp.model.config import SHARED_FIELDS, ModelConfig
from diffexp.training.hparams import (
    BEST_VAL_LOSS,
    FINAL_VAL_LOSS,
    METRICS,
    TOKENS_PER_S,
    TRAIN_LOSS,
    hparam_value,
    write_row,
)
from tests.helpers import scalars, write_recipe


def hparams_tab(logdir: Path) -> tuple[list[str], dict[str, dict]]:
    """What TensorBoard's HParams tab shows for `tensorboard --logdir LOGDIR`: the metric tags, and per run
    (session group) its hparams and metric values."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, get_experiment, list_session_groups

    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    provider = data_provider.MultiplexerDataProvider(multiplexer, str(logdir))
    backend = backend_context.Context(base_plugin.TBContext(logdir=str(logdir), multiplexer=multiplexer,
                                                            data_provider=provider))
    request = context.RequestContext()
    experiment = get_experiment.Handler(request, backend, "",
                                        api_pb2.GetExperimentRequest(include_metrics=True)).run()
    columns = [api_pb2.ColParams(hparam=h.name) for h in experiment.hparam_infos]
    columns += [api_pb2.ColParams(metric=m.name) for m in experiment.metric_infos]
    groups = list_session_groups.Handler(request, backend, "", api_pb2.ListSessionGroupsRequest(
        start_index=0, slice_size=100, include_metrics=True, col_params=columns,
        allowed_statuses=[api_pb2.STATUS_UNKNOWN, api_pb2.STATUS_SUCCESS, api_pb2.STATUS_FAILURE,
                          api_pb2.STATUS_RUNNING])).run().session_groups
    rows = {group.name: {"hparams": {k: getattr(v, v.WhichOneof("kind")) for k, v in group.hparams.items()},
                         "metrics": {m.name.tag: m.value for m in group.metric_values}} for group in groups}
    return [m.name.tag for m in experiment.metric_infos], rows


def hparams_summaries(run_dir: Path) -> dict[str, int]:
    """How many of each hparams plugin summary the run's event files hold (TensorBoard reads only the first)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import metadata

    counts: dict[str, int] = {}
    for path in sorted(run_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == metadata.PLUGIN_NAME:
                    counts[value.tag] = counts.get(value.tag, 0) + 1
    return counts


def fit(tmp_path: Path, *args: str, attention: str = "diff_v1", max_steps: int = 8) -> None:
    main(["fit", "--config", str(write_recipe(tmp_path, name="cmp", attention=attention, max_steps=max_steps)),
          *args])


@pytest.fixture(scope="module")
def two_fits(tmp_path_factory) -> Path:
    """runs/cmp/ of a baseline fit (version_0) and a DIFF V1 fit (version_1), 8 steps each, validated at 6 and 8."""
    tmp_path = tmp_path_factory.mktemp("fits")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        for attention in ("baseline", "diff_v1"):
            fit(tmp_path, attention=attention)
    return tmp_path / "runs/cmp"


@pytest.mark.slow
def test_two_fits_compare_side_by_side_with_the_variant_as_a_column(two_fits):
    metrics, rows = hparams_tab(two_fits)
    assert metrics == list(METRICS)
    assert {name: row["hparams"]["model.arch.attention"] for name, row in rows.items()} == {"version_0": "baseline",
                                                                               "version_1": "diff_v1"}
    for name, row in rows.items():
        logged = scalars(two_fits / name)
        val_losses = [value for _, value in logged["val/loss"]]
        assert len(val_losses) == 2
        assert row["metrics"][FINAL_VAL_LOSS] == pytest.approx(val_losses[-1], rel=1e-6)
        assert row["metrics"][BEST_VAL_LOSS] == pytest.approx(min(val_losses), rel=1e-6)
        assert row["metrics"][TRAIN_LOSS] == pytest.approx(logged["train/loss"][-1][1], rel=1e-6)  # the last step's
        tokens_per_s = statistics.median(v for _, v in logged["vitals/throughput/tokens_per_s"])  # the summary's
        assert row["metrics"][TOKENS_PER_S] == pytest.approx(tokens_per_s, rel=1e-6)
        assert [step for step, _ in logged[BEST_VAL_LOSS]] == [8]  # one reading, at the run's last step


@pytest.mark.slow
def test_each_run_records_its_variant_flags_and_parameter_counts(two_fits):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    headers = []
    for run_dir, attention in ((two_fits / "version_0", "baseline"), (two_fits / "version_1", "diff_v1")):
        assert hparams_summaries(run_dir) == {metadata.EXPERIMENT_TAG: 1, metadata.SESSION_START_INFO_TAG: 1}
        content = EventAccumulator(str(run_dir)).Reload().PluginTagToContent(metadata.PLUGIN_NAME)
        experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
        assert [m.name.tag for m in experiment.metric_infos] == list(METRICS)
        headers.append(sorted((h.name, h.type) for h in experiment.hparam_infos))
        start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
        row = {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}
        arch = torch.load(run_dir / "checkpoints/last.ckpt", weights_only=True)["hyper_parameters"]["arch"]
        assert row["model.arch.attention"] == attention == arch["attention"]
        # the flags the variant reads (the shared ones and its registry entry's); its name and own flags marked as
        # what tells runs apart, which the tab lists first among the five columns it shows until others are ticked
        own = ["attention", *variant(attention).fields]
        read = own + [name for name in SHARED_FIELDS if name not in own]
        header = experiment_order(content)
        assert sorted(h for h, _ in header if h.startswith("model.arch.")) == sorted(f"model.arch.{k}" for k in read)
        assert sorted(h for h, differs in header if differs) == sorted(f"model.arch.{k}" for k in own)
        flags = {k: v for k, v in arch.items() if k in read}
        assert sorted(k for k in row if k.startswith("model.arch.")) == sorted(f"model.arch.{k}" for k in flags)
        for name, value in flags.items():  # a number, or the text a recipe writes
            recorded = row[f"model.arch.{name}"]
            assert recorded == (value if isinstance(recorded, float) else hparam_value(value, as_text=True)), name
        assert (row["model.arch.d_model"], row["model.arch.n_heads"], row["model.arch.vocab_size"]) == (32, 2, 257)
        assert row["model.arch.n_kv_heads"] == "null"  # one type a column
        assert ("model.arch.head_norm" in row) == (attention == "diff_v1")  # the baseline reads no head norm
        report = Decoder(ModelConfig(**arch)).parameter_report()
        assert {k: v for k, v in row.items() if k.startswith("params/")} == {f"params/{k}": v
                                                                             for k, v in report.items()}
    assert set(headers[0]) < set(headers[1])  # DIFF V1's header adds its own flags to the baseline's


def experiment_order(content) -> list[tuple[str, bool]]:
    """The header's columns, each with whether it is marked as telling runs apart (the tab lists those first)."""
    from tensorboard.plugins.hparams import metadata

    experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    return [(h.name, h.differs) for h in experiment.hparam_infos]


@pytest.mark.slow
def test_a_resumed_run_keeps_its_one_row_and_ends_it_with_its_new_results(tmp_path, monkeypatch):
    from tensorboard.plugins.hparams import metadata

    monkeypatch.chdir(tmp_path)
    fit(tmp_path)
    fit(tmp_path, "--ckpt_path", "last", "--model.optim.schedule_steps", "8", max_steps=12)  # 4 steps more
    run_dir = tmp_path / "runs/cmp/version_0"
    assert hparams_summaries(run_dir) == {metadata.EXPERIMENT_TAG: 1, metadata.SESSION_START_INFO_TAG: 1}
    _, rows = hparams_tab(tmp_path / "runs/cmp")
    assert list(rows) == ["version_0"]
    val_losses = [value for _, value in scalars(run_dir)["val/loss"]]
    assert len(val_losses) == 3  # after 6 and 8 steps, then 12
    assert rows["version_0"]["metrics"][FINAL_VAL_LOSS] == pytest.approx(val_losses[-1], rel=1e-6)
    assert rows["version_0"]["metrics"][BEST_VAL_LOSS] == pytest.approx(min(val_losses), rel=1e-6)  # both parts
    assert [step for step, _ in scalars(run_dir)[BEST_VAL_LOSS]] == [8, 12]


@pytest.mark.slow
def test_fits_without_a_logger_or_with_autolog_off_write_no_row(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fit(tmp_path, "--trainer.logger", "false", max_steps=2)
    assert not (tmp_path / "runs").exists()
    fit(tmp_path, "--trainer.enable_autolog_hparams", "false", max_steps=2)  # as a sweep's trials (their own row)
    assert hparams_summaries(tmp_path / "runs/cmp/version_0") == {}
    assert not ({BEST_VAL_LOSS, TOKENS_PER_S} & set(scalars(tmp_path / "runs/cmp/version_0")))


@pytest.mark.parametrize("closed", [False, True], ids=["open", "after-fit"])
def test_a_row_is_written_into_the_run_directory_itself(tmp_path, closed):
    """write_row goes through TensorBoard's public writer into the run's own directory (no subdirectory, a run of
    its own, as SummaryWriter.add_hparams makes), where the HParams tab shows it as that run's row with its latest
    values; also once the logger has closed its writer (the validation after fit)."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    logger = TensorBoardLogger(tmp_path / "runs", name="cmp", version=0)
    logger.log_metrics({FINAL_VAL_LOSS: 2.5}, step=4)
    if closed:
        logger.finalize("success")
    columns = {"model.arch.attention": "diff_v1", "model.arch.depth": 2, "params/total": 1000}
    write_row(logger, columns, metrics=(FINAL_VAL_LOSS,), leading=1)
    logger.log_metrics({FINAL_VAL_LOSS: 2.25}, step=8)
    logger.finalize("success")
    run_dir = tmp_path / "runs/cmp/version_0"
    assert not [path for path in run_dir.rglob("*") if path.is_dir()]
    assert hparams_summaries(run_dir) == {metadata.EXPERIMENT_TAG: 1, metadata.SESSION_START_INFO_TAG: 1}
    metrics, rows = hparams_tab(tmp_path / "runs/cmp")
    assert metrics == [FINAL_VAL_LOSS]
    assert rows == {"version_0": {"hparams": columns, "metrics": {FINAL_VAL_LOSS: 2.25}}}
    content = EventAccumulator(str(run_dir)).Reload().PluginTagToContent(metadata.PLUGIN_NAME)
    assert experiment_order(content) == [(name, name == "model.arch.attention") for name in columns]


def test_values_become_what_tensorboard_accepts_and_passwords_never_reach_it():
    from torch.utils.tensorboard.summary import hparams

    values = {"none": None, "list": [0.9, 0.95], "nested": {"a": {"b": 1}}, "flag": True, "word": "depth", "int": 3,
              "float": 0.5, "url": "postgresql://me:hunter22@db/optuna", "object": object}
    row = {k: hparam_value(v) for k, v in values.items()}
    assert row == {"none": "null", "list": "[0.9, 0.95]", "nested": '{"a": {"b": 1}}', "flag": "true",
                   "word": "depth", "int": 3, "float": 0.5, "url": "postgresql://me:***@db/optuna",
                   "object": "<class 'object'>"}
    assert hparam_value(2, as_text=True) == "2"
    hparams(row, {FINAL_VAL_LOSS: 0.0})  # TensorBoard's own writer takes every value (it raises on others)
