"""The lists in the docs that the code decides: the `model.arch` flags (the variant registry) and the GPU sizes
(recipes/gpu/size/). A variant, a flag or a size added without its line in the docs fails here, naming it."""

from __future__ import annotations

import re

from diffexp.model.attention import variants
from diffexp.model.config import SHARED_FIELDS
from tests.helpers import REPO

DOCS = REPO / "docs"
GPU_SIZES = {path.stem for path in (REPO / "recipes/gpu/size").glob("*.yaml")}


def section(text: str, heading: str) -> str:
    """The body of the markdown section `heading` (its own line), up to the next heading of any level."""
    lines = text.splitlines()
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("#")), len(lines))
    return "\n".join(lines[start:end])


def without_parentheses(text: str) -> str:
    while re.search(r"\([^()]*\)", text):
        text = re.sub(r"\([^()]*\)", "", text)
    return text


def flag_lists(text: str) -> dict[str, list[str]]:
    """The bullets of a flag list, `- WHO: `flag` (values), `flag`, ...`, as who -> the flags it names (the
    backquoted words outside parentheses); WHO is `shared` or a variant's name in backquotes."""
    bullets = re.findall(r"^- (.+?)(?=^- |\Z)", text, flags=re.MULTILINE | re.DOTALL)
    lists = {}
    for bullet in bullets:
        who, _, names = " ".join(bullet.split()).partition(":")
        lists[who.strip("`")] = re.findall(r"`([a-z_0-9]+)`", without_parentheses(names))
    return lists


def differences(what: str, documented: list[str], declared: list[str]) -> list[str]:
    missing = [name for name in declared if name not in documented]
    extra = list(dict.fromkeys(name for name in documented if name not in declared))
    repeated = sorted({name for name in documented if documented.count(name) > 1})
    return ([f"{what}: missing {', '.join(missing)}"] if missing else []) + \
        ([f"{what}: not declared, yet listed: {', '.join(extra)}"] if extra else []) + \
        ([f"{what}: listed twice: {', '.join(repeated)}"] if repeated else [])


def test_the_flag_list_of_training_md_is_the_registrys():
    lists = flag_lists(section((DOCS / "training.md").read_text(), "## Model flags"))
    declared = {"shared": list(SHARED_FIELDS), **{entry.name: list(entry.fields) for entry in variants()}}
    problems = differences("docs/training.md, Model flags: the lists", list(lists), list(declared))
    for who in declared.keys() & lists.keys():
        problems += differences(f"docs/training.md, Model flags, {who}", lists[who], declared[who])
    assert not problems, "\n".join(problems)


def test_the_size_lists_of_the_docs_are_the_gpu_recipes():
    training = (DOCS / "training.md").read_text()
    listed = re.search(r"`size/<size>\.yaml` \(sizes: ([^)]*)\)", " ".join(training.split()))
    assert listed, "docs/training.md: no `size/<size>.yaml` (sizes: ...) list"
    sizes = [size.strip() for size in listed.group(1).split(",")]
    problems = differences("docs/training.md, the GPU recipes' sizes", sizes, sorted(GPU_SIZES))
    table = section((DOCS / "gpu.md").read_text(), "## Sizes")
    rows = re.findall(r"^\| (\d[\w.]*) \|", table, flags=re.MULTILINE)
    problems += differences("docs/gpu.md, Sizes: the table's rows", rows, sorted(GPU_SIZES))
    assert not problems, "\n".join(problems)


def test_each_variants_section_of_variants_md_names_every_flag_it_reads():
    text = (DOCS / "variants.md").read_text()
    problems = []
    for entry in variants():
        heading = next((line for line in text.splitlines() if re.match(rf"#+ `{entry.name}`", line)), None)
        if heading is None:
            problems.append(f"docs/variants.md: no section `{entry.name}`")
            continue
        body = section(text, heading)
        missing = [flag for flag in entry.fields if not re.search(rf"`{flag}(`|: )", body)]
        if missing:
            problems.append(f"docs/variants.md, {heading.lstrip('# ')}: names no {', '.join(missing)}")
    assert not problems, "\n".join(problems)


def test_evaluations_md_gives_every_registered_evaluation_its_command():
    """Each entry of the evaluation registry is described with its `diffexp eval NAME` command, and every such
    command the page names is a registered evaluation."""
    from diffexp.evals.registry import evaluation_names

    text = (DOCS / "evaluations.md").read_text()
    named = set(re.findall(r"diffexp eval (\w+) ", text)) - {"NAME"}
    problems = differences("docs/evaluations.md, the `diffexp eval NAME` commands", sorted(named),
                           sorted(evaluation_names()))
    assert not problems, "\n".join(problems)


def test_the_readmes_tested_versions_start_at_pyprojects_floors():
    """README's "Tested with ..." line names each key dependency's floor as pyproject declares it."""
    pyproject = (REPO / "pyproject.toml").read_text()
    readme = (REPO / "README.md").read_text()
    line = next(line for line in readme.split("\n\n") if line.startswith("Tested with"))
    for name, written in (("torch", "torch"), ("lightning", "Lightning"), ("jsonargparse", "jsonargparse"),
                          ("optuna", "Optuna")):
        floor = re.search(rf'"{name}(?:\[\w+\])?>=([\d.]+)', pyproject).group(1)
        assert re.search(rf"{written} {re.escape(floor)}\b", " ".join(line.split())), (name, floor, line)


def test_a_flag_missing_from_a_list_is_named():
    """The checks above can fail, and say what is wrong."""
    text = "- shared: `d_model` (`sdpa`, or `eager`), `n_layers`\n- `gated`: `gate`,\n  `sink`\n"
    assert flag_lists(text) == {"shared": ["d_model", "n_layers"], "gated": ["gate", "sink"]}
    assert differences("x", ["gate", "sink", "sink"], ["gate", "rank"]) == [
        "x: missing rank", "x: not declared, yet listed: sink", "x: listed twice: sink"]
