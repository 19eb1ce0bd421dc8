"""`diffexp params` reads recipes without Lightning (diffexp.training.recipe) and gets what `diffexp fit`'s parser
gets: for EVERY recipe under recipes/ (globbed, GPU size x variant combinations included), every value the light
reader holds is the one fit's parser holds (the same type too), and the model config, the parameter counts, the
budget and the memory settings `params` prints from each are equal. What only fit's parser can judge goes to it,
and params' figures are then fit's; an unknown key of diffexp's own sections is refused by the reader itself, in
fit's words (the key as written, the file, what is allowed).
"""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import yaml

from diffexp.compare import params
from diffexp.compare.budget import run_budget
from diffexp.compare.params import Recipe, all_recipes, fit_parsed, gpu_files
from diffexp.errors import UserError
from diffexp.training.recipe import (
    CHECKPOINT_KEYS,
    READ_SECTIONS,
    TRAINER_KEYS,
    UNREAD_SECTIONS,
    NeedsFitParser,
    read_recipe,
)
from diffexp.training.values import data_init_args, to_builtin
from tests.helpers import REPO, stdout_of

GPU = REPO / "recipes/gpu"
#: every recipe `params` counts, then each GPU extension delta given last after the run it extends (the 3B DIFF V1
#: one its header names)
RECIPES = sorted(all_recipes(REPO / "recipes"), key=lambda r: r.name) + [
    Recipe(f"gpu/3b + diff_v1 + extend/{path.stem}", (*gpu_files(GPU, "3b", "diff_v1"), path))
    for path in sorted((GPU / "extend").glob("*.yaml"))]


def leaves(value, path: str = "") -> dict:
    """{dotted path: value} of a nested mapping; a list is one leaf."""
    if isinstance(value, dict):
        return {p: v for key, item in value.items() for p, v in leaves(item, f"{path}{key}.").items()}
    return {path[:-1]: value}


def same(a, b) -> bool:
    """Equal and of the same types, all the way down (1 == 1.0 == True is not enough)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def figures(recipe: Recipe, config) -> dict:
    """What `params` prints of a recipe, from a config, as params computes it: model config, counts, budget,
    memory settings."""
    arch = params.model_config(recipe, config)
    return {"arch": arch, "counts": params.report(recipe, config), "budget": params.budget(recipe, config),
            "memory": params.memory_settings(config, arch), "vocab": params.linked_vocab_size(config)}


def fits_figures(recipe: Recipe, config) -> dict:
    """The same from fit's parsed config, the model built under plain torch.device("meta")."""
    import torch

    from diffexp.model import Decoder

    arch = params.model_config(recipe, config)
    sdpa = replace(arch, backend="sdpa")
    with torch.device("meta"):
        model = Decoder(sdpa)
    return {"arch": arch, "counts": {"attention_variant": arch.attention, **model.parameter_report()},
            "budget": run_budget(config, sdpa, model), "memory": params.memory_settings(config, arch),
            "vocab": params.linked_vocab_size(config)}


def write(tmp_path, name: str, content: dict):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(content))
    return path


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_every_recipe_reads_as_fits_parser_reads_it(recipe, monkeypatch):
    monkeypatch.chdir(REPO)
    light = read_recipe(recipe.configs)  # no recipe under recipes/ needs fit's parser
    fit_config = fit_parsed(recipe)
    fit = leaves(to_builtin(fit_config))
    differ = {path: (value, fit.get(path, "(absent)")) for path, value in leaves(light).items()
              if not same(value, fit.get(path))}
    assert not differ, f"{recipe.name}: light reader vs fit's parser: {differ}"
    assert to_builtin(light["model"]).keys() == to_builtin(fit_config["model"]).keys()
    # every data argument, defaults included (as params reads them: to_builtin makes a dict's tuples lists)
    assert same(to_builtin(data_init_args(light)), to_builtin(data_init_args(fit_config)))
    assert figures(recipe, light) == fits_figures(recipe, fit_config)


def test_every_recipe_file_is_read_above():
    read = {path.resolve() for recipe in RECIPES for path in recipe.configs}
    assert set((REPO / "recipes").rglob("*.yaml")) <= read


def test_the_reader_knows_only_what_fit_accepts():
    """Each key the reader lets through is one fit's parser has: its sections, and Lightning's Trainer arguments
    (a Lightning that drops one makes this fail, rather than params accept what fit refuses)."""
    from lightning.pytorch import Trainer

    fit_config = fit_parsed(Recipe("tiny", (REPO / "recipes/tiny/diff_v1.yaml",)))
    assert set(READ_SECTIONS + UNREAD_SECTIONS) <= set(to_builtin(fit_config))
    assert set(TRAINER_KEYS) <= set(inspect.signature(Trainer.__init__).parameters)
    from lightning.pytorch.callbacks import ModelCheckpoint

    assert set(CHECKPOINT_KEYS) <= set(inspect.signature(ModelCheckpoint.__init__).parameters)
    assert set(CHECKPOINT_KEYS) <= set(to_builtin(fit_config)["checkpoint"])


def test_the_synthetic_vocabularies_are_the_built_modules():
    """params.SYNTHETIC_VOCAB gives what building the data module gives (its vocab_size), for every recipe of a
    synthetic task that names no vocab_size."""
    import importlib

    checked = set()
    for recipe in RECIPES:
        config = read_recipe(recipe.configs)
        class_path, args = data_init_args(config)
        if class_path in params.SYNTHETIC_VOCAB and args.get("vocab_size") is None:
            module, _, name = class_path.rpartition(".")
            built = getattr(importlib.import_module(module), name)(**args)
            assert params.linked_vocab_size(config) == built.vocab_size, recipe.name
            checked.add(class_path)
    assert checked == set(params.SYNTHETIC_VOCAB)


def test_values_the_reader_converts_are_fits(tmp_path):
    """An integer for a number is a number, as fit's parser makes it; a data module's list of pairs stays lists;
    a later file's flat data keys merge into an earlier file's class."""
    base = write(tmp_path, "base.yaml", {
        "model": {"arch": {"attention": "diff_v1", "rope_theta": 80000, "lambda_init": 0.5, "n_kv_heads": None},
                  "optim": {"betas": [0.9, 0.95], "lr": 1}, "vocab_size": 300},  # linked: the data's wins
        "data": {"class_path": "diffexp.data.needle.NeedleDataModule",
                 "init_args": {"context_len": 256, "nr_mix": [[1, 1], [2, 2]]}},
        "trainer": {"max_steps": 50, "accumulate_grad_batches": 2}})
    later = write(tmp_path, "later.yaml", {"data": {"batch_size": 4}, "model": {"arch": {"d_model": 64}}})
    recipe = Recipe("x", (base, later))
    light, fit_config = read_recipe(recipe.configs), fit_parsed(recipe)
    fit = leaves(to_builtin(fit_config))
    differ = {path: (value, fit.get(path)) for path, value in leaves(light).items() if not same(value, fit.get(path))}
    assert not differ
    assert light["model"]["arch"]["rope_theta"] == 80000.0 and light["data"]["init_args"]["batch_size"] == 4
    assert params.linked_vocab_size(light) == 257
    assert figures(recipe, light) == fits_figures(recipe, fit_config)


@pytest.mark.parametrize("content, reason", [
    ({"model": {"arch": {"d_model": "64"}}}, "model.arch.d_model"),  # jsonargparse reads "64" as 64
    ({"model": {"optim": {"lr": "1e-3"}}}, "model.optim.lr"),  # and 1e-3 as a number (YAML 1.1: a string)
    ({"trainer": {"max_step": 5}}, "trainer.max_step"),  # not a Trainer argument the reader knows
    ({"trainer": {"deterministic": True, "max_steps": "7"}}, "trainer.max_steps"),
    ({"data": {"class_path": "my_lab.data.Corpus"}}, "my_lab.data.Corpus"),
    ({"ckpt_path": "last"}, "ckpt_path"),
    ({"trainer": {"gradient_clip_val": "1.0"}}, "trainer.gradient_clip_val"),  # a value check_trainer compares
    ({"checkpoint": {"every_n_train_stepz": 5}}, "checkpoint.every_n_train_stepz"),  # keys fit's callbacks lack
    ({"diagnostics": {"every_n_step": 5}}, "diagnostics.every_n_step"),
    ({"throughput": {"peak_tflop": 5}}, "throughput.peak_tflop"),
])
def test_what_only_fits_parser_can_judge_goes_to_it(tmp_path, content, reason):
    path = write(tmp_path, "recipe.yaml", content)
    with pytest.raises(NeedsFitParser, match=reason):
        read_recipe([path])


def test_a_class_changed_by_a_later_file_goes_to_fits_parser(tmp_path):
    text = write(tmp_path, "text.yaml", {"data": {"seq_len": 64}})
    needle = write(tmp_path, "needle.yaml", {"data": {"class_path": "diffexp.data.needle.NeedleDataModule"}})
    with pytest.raises(NeedsFitParser, match="class_path"):
        read_recipe([text, needle])


def test_params_figures_are_fits_where_fits_parser_reads_the_recipe(tmp_path, monkeypatch):
    """A recipe the reader leaves to fit's parser (a number written as a string) still gets its figures."""
    path = write(tmp_path, "recipe.yaml", {"model": {"arch": {"attention": "diff_v1", "d_model": "64",
                                                              "n_layers": 2}}})
    recipe = Recipe("x", (path,))
    params.parsed.cache_clear()
    assert params.model_config(recipe).d_model == 64
    assert params.report(recipe) == params.report(recipe, fit_parsed(recipe))


@pytest.mark.parametrize("content, key, allowed, nearest", [
    ({"model": {"arch": {"n_head": 8}}}, "model.arch.n_head", "n_heads, n_kv_heads", "model.arch.n_heads"),
    ({"model": {"archi": {"d_model": 64}}}, "model.archi", "arch, optim, ar_hit, compile, init_from", "model.arch"),
    ({"model": {"optim": {"warmup": 5}}}, "model.optim.warmup", "warmup_steps", None),
    ({"data": {"seq_lne": 64}}, "data.seq_lne", "source, text_field", "data.seq_len"),
    ({"data": {"class_path": "diffexp.data.needle.NeedleDataModule", "init_args": {"context": 64}}},
     "data.context", "context_len, n_needles", "data.context_len"),
    ({"global_batch": {"row": 64}}, "global_batch.row", "rows", "global_batch.rows"),
])
def test_an_unknown_key_is_refused_as_fit_refuses_it(tmp_path, content, key, allowed, nearest):
    """The reader's message: the file, the key as written, the keys allowed, the nearest one; fit refuses the
    same recipe."""
    path = write(tmp_path, "recipe.yaml", content)
    with pytest.raises(UserError) as refused:
        read_recipe([path])
    message = str(refused.value)
    assert message.startswith(f"RECIPE {path}: unknown key(s) {key}") and allowed in message, message
    assert (f"did you mean {nearest}?" in message) == (nearest is not None), message
    with pytest.raises(UserError):
        fit_parsed(Recipe("x", (path,)))


def test_an_unknown_key_of_an_empty_mapping_is_no_key(tmp_path):
    """`model.archi: {}` holds no setting, and fit's parser accepts it: so does the reader."""
    path = write(tmp_path, "recipe.yaml", {"model": {"archi": {}, "arch": {"d_model": 64}}})
    assert read_recipe([path])["model"]["arch"]["d_model"] == 64
    fit_parsed(Recipe("x", (path,)))


def test_the_file_that_holds_an_unknown_key_is_named(tmp_path):
    base = write(tmp_path, "base.yaml", {"model": {"arch": {"attention": "diff_v1"}}})
    size = write(tmp_path, "size.yaml", {"model": {"arch": {"d_modle": 64}}})
    with pytest.raises(UserError, match=f"^RECIPE {size}: unknown key\\(s\\) model.arch.d_modle"):
        read_recipe([base, size])


@pytest.mark.parametrize("content", [
    {"model": {"arch": {"attention": "diff_v1", "n_heads": 3}}},
    {"model": {"arch": {"attention": "diff_v9"}}},
    {"model": {"optim": {"lr": -1.0}}},
    {"model": {"ar_hit": {"min_count": 2, "top_percent": 1.0}}},
])
def test_a_bad_value_is_refused_in_fits_words(tmp_path, content):
    """A value of the right type that a model dataclass refuses: the reader's message is fit's own."""
    from diffexp.training.preflight import validate_fit_config

    path = write(tmp_path, "recipe.yaml", content)
    with pytest.raises(UserError) as light:
        read_recipe([path])
    with pytest.raises(UserError) as fit:
        validate_fit_config(fit_parsed(Recipe("x", (path,))), "fit")
    assert str(light.value) == str(fit.value) and str(light.value).startswith("model.")


@pytest.mark.parametrize("trainer", [{"max_steps": 0}, {"max_steps": -1}, {"gradient_clip_val": -1.0},
                                     {"accumulate_grad_batches": 0}, {"log_every_n_steps": 0},
                                     {"val_check_interval": 0}, {"limit_val_batches": -2}],
                         ids=lambda trainer: next(iter(trainer)) + f"={next(iter(trainer.values()))}")
def test_a_trainer_value_fit_refuses_is_refused_in_fits_words(tmp_path, trainer):
    """params prints no figures for a run fit would refuse before any work (max_steps 0 would read as a run "not
    bounded by steps"): the reader's message is fit's own, and so is params' where fit's parser reads the recipe."""
    from diffexp.training.cli import parse_config
    from diffexp.training.preflight import validate_fit_config

    path = write(tmp_path, "recipe.yaml", {"trainer": trainer})
    with pytest.raises(UserError) as light:
        read_recipe([path])
    with pytest.raises(UserError) as fit:
        validate_fit_config(parse_config(["--config", str(path)]), "fit")
    assert str(light.value) == str(fit.value) and str(light.value).startswith(f"trainer.{next(iter(trainer))}=")
    unread = write(tmp_path, "unread.yaml", {"trainer": {**trainer, "sync_batchnorm": False}})  # fit's parser's
    with pytest.raises(NeedsFitParser):
        read_recipe([unread])
    with pytest.raises(UserError) as parsed:
        fit_parsed(Recipe("x", (unread,)))
    assert str(parsed.value) == str(fit.value)


def test_diffexp_params_refuses_bad_recipes_in_one_paragraph(tmp_path, capsys):
    """Through the CLI guard: exit 2, `error: ...`, no traceback, for the reader's refusals and fit's."""
    from diffexp.cli import main

    cases = {"unknown.yaml": ({"model": {"arch": {"colour": 1}}}, "model.arch.colour"),
             "bad.yaml": ({"model": {"arch": {"backend": "SDPA"}}}, "'SDPA'"),  # fit's parser words this one
             "trainer.yaml": ({"trainer": {"max_step": 5}}, "trainer.max_step"),
             # fit's words for an unknown key of a recipe: the file, the key, the nearest key
             "trainer-file.yaml": ({"trainer": {"max_stepz": 10}}, "trainer-file.yaml: unknown key(s) "
                                   "trainer.max_stepz; trainer.max_stepz: did you mean trainer.max_steps?"),
             "checkpoint.yaml": ({"checkpoint": {"save_lst": True}}, "unknown key(s) checkpoint.save_lst; "
                                 "checkpoint.save_lst: did you mean checkpoint.save_last?"),
             "max-steps.yaml": ({"trainer": {"max_steps": 0}}, "trainer.max_steps=0 is invalid"),
             "yaml.yaml": (None, "not valid YAML")}
    for name, (content, expected) in cases.items():
        path = tmp_path / name
        path.write_text(yaml.safe_dump(content) if content is not None else "model: [unclosed\n")
        with pytest.raises(SystemExit) as done:
            main(["params", str(path)])
        err = capsys.readouterr().err
        assert done.value.code == 2 and err.startswith("error: ") and expected in err, (name, err)
        assert "Traceback" not in err


def test_diffexp_params_prints_fits_counts_for_a_gpu_combination(monkeypatch):
    monkeypatch.chdir(REPO)
    recipe = next(r for r in RECIPES if r.name == "gpu/830m + diff_v2")
    counts = params.report(recipe, fit_parsed(recipe))
    printed = stdout_of(["params", "recipes/gpu/variant/diff_v2/830m.yaml"])
    assert f"{counts['total']:,}" in printed and f"{counts['attention']:,}" in printed
