"""README.md is a front page, and every command it shows is exercised.

Each command line of README.md's shell blocks is one of:
- a line `.ci/run` runs (the set-up and the test command of the quick start);
- a command parsed here by its program's real parser on the exact argv, without running the job: every
  `diffexp ...` subcommand (LightningCLI for fit/validate/test, the subcommand's argparse parser otherwise),
  `torchrun ... -m diffexp ...`, `tensorboard ...`, and `export VAR=...` of a variable diffexp reads;
- a command listed in ELSEWHERE with the test that runs it.
Any other command fails the test. The pages the README links to for the details (docs/*.md, docs/results/*.md,
bench/README.md) hold the commands that moved out of it; theirs are checked the same way. Every Python block of
the README runs as shown. Also: every relative link in these pages
names a file that exists (and, with #anchor, one of its headings), as does every repository path they name in
backquotes, and every pointer in a recipe's or sweep spec's comments (a file, a #heading, or `file, "Section"`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
CI_RUN = REPO / ".ci" / "run"
#: the pages whose links and paths are checked
PAGES = [README, REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md")),
         *sorted((REPO / "docs" / "results").glob("*.md"))]
#: the files whose comments point at pages and sections
COMMENTED = sorted([*(REPO / "recipes").rglob("*.yaml"), *(REPO / "sweeps").glob("*.yaml")])
SHELL = {"bash", "sh", "shell", "console"}
#: what a README command's shell variables stand for when it is parsed
PLACEHOLDERS = {"$NODE_RANK": "0", "$MASTER": "127.0.0.1"}
#: environment variables a README command may set (`export NAME=...`), each one diffexp reads
ENV_VARS = {"DIFFEXP_STORAGE": "diffexp.sweep.storage:STORAGE_URL_ENV"}
#: README commands that are not parsed here, and the test that runs each one ("path::function")
ELSEWHERE = {
    "python -m pytest -q -m heavy": "tests/test_readme.py::test_heavy_tests_exist_and_stay_out_of_the_default_run",
    "bash bench/gpu.sh OUT_DIR": "tests/test_bench_recipe.py::test_the_gpu_script_runs_end_to_end_on_cpu_in_smoke_mode",
    "bash bench/gpu_wheels.sh": "tests/test_bench_recipe.py::test_the_gpu_wheels_are_what_the_gpu_script_installs",
    "python bench/startup.py --rounds 5 --checkpoint CKPT --runs RUNS --prepared PREPARED":
        "tests/test_startup.py::test_the_startup_bench_times_and_tables_its_commands",
}


# --- reading the README ------------------------------------------------------------------------------------

def fenced_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(info string, lines) of every fenced code block; a fence may be indented (inside a list item)."""
    blocks, info, body = [], None, []
    for line in text.splitlines():
        fence = re.match(r"\s*```(.*)$", line)
        if info is None and fence:
            info, body = fence.group(1).strip(), []
        elif info is not None and fence and not fence.group(1).strip():
            blocks.append((info, body))
            info = None
        elif info is not None:
            body.append(line)
    assert info is None, "a code block is not closed"
    return blocks


def command_lines(body: list[str]) -> list[str]:
    """The logical lines of a shell block: continuations joined, comment-only and blank lines left out."""
    lines, pending = [], ""
    for raw in body:
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    assert not pending, f"a continued line ends the block: {pending}"
    return lines


def words(line: str) -> list[str]:
    """The shell words of a line, operators (&&, |, >, ;) as words of their own; a trailing comment dropped.
    A placeholder inside a word (bench/results/<earlier>.json) stands for a name, not a redirection."""
    line = re.sub(r"(?<=[\w/.-])<([\w-]+)>", r"\1", line)
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def simple_commands(line: str) -> list[list[str]]:
    """A line cut into commands at &&, ||, | and ;, with redirections (> FILE) left out."""
    commands, current, tokens = [], [], iter(words(line))
    for token in tokens:
        if token in ("&&", "||", "|", ";"):
            commands.append(current)
            current = []
        elif token in (">", ">>", "<", "2>"):
            next(tokens, None)
        else:
            current.append(token)
    return [c for c in [*commands, current] if c]


def shown_commands(page: Path) -> list[str]:
    """Every command line of a page's shell blocks."""
    return [line for info, body in fenced_blocks(page.read_text()) if info in SHELL for line in command_lines(body)]


def readme_commands() -> list[str]:
    return shown_commands(README)


def detail_commands() -> list[tuple[str, str]]:
    """(page, command) of the pages that hold the README's details."""
    return [(str(page.relative_to(REPO)), line) for page in PAGES if page != README for line in shown_commands(page)]


def ci_lines() -> set[str]:
    return {" ".join(line.split()) for line in CI_RUN.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")}


# --- parsing a command without running it -----------------------------------------------------------------

class Parsed(BaseException):
    """Raised by the patched ArgumentParser.parse_args once the argv has parsed: the job does not run. A
    BaseException, so neither diffexp's error guards nor a subcommand's `except Exception` stop it."""


@contextlib.contextmanager
def stop_after_parsing():
    """argparse's parsers and jsonargparse's (`diffexp eval NAME`'s options) stop once they have parsed."""
    import jsonargparse

    originals = {cls: cls.__dict__["parse_args"] for cls in (argparse.ArgumentParser, jsonargparse.ArgumentParser)}

    def stopping(original):
        def parse_then_stop(self, *args, **kwargs):
            original(self, *args, **kwargs)
            raise Parsed()
        return parse_then_stop

    for cls, original in originals.items():
        cls.parse_args = stopping(original)
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.parse_args = original


def parse_lightning(subcommand: str, args: list[str]) -> None:
    """fit, validate, test: LightningCLI's parser on the recipe and every flag (--print_config prints, exit 0)."""
    from diffexp.cli import parse_config

    with contextlib.redirect_stdout(io.StringIO()):
        try:
            parse_config(args, subcommand)
        except SystemExit as stop:
            assert stop.code in (0, None), f"diffexp {subcommand} {shlex.join(args)}: exit {stop.code}"


def parse_diffexp(argv: list[str]) -> str:
    """Parse `diffexp ARGV` as the CLI would, stopping before the job; what was checked."""
    from diffexp.cli import main

    if not argv or argv[0] == "variants" or "-h" in argv or "--help" in argv:  # cheap: run it
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                main(argv or ["--help"])
            except SystemExit as stop:
                assert stop.code in (0, None), f"diffexp {shlex.join(argv)}: exit {stop.code}"
        return "run"
    if argv[0] in ("fit", "validate", "test"):
        parse_lightning(argv[0], argv[1:])
        return "parsed by LightningCLI"
    if argv[:2] == ["bench", "trainer"] and "--" in argv:  # its FIT ARGS are a fit's flags
        parse_lightning("fit", argv[argv.index("--") + 1:])
    err = io.StringIO()
    with stop_after_parsing(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except Parsed:
            return "parsed by its argparse parser"
        except SystemExit as stop:
            pytest.fail(f"diffexp {shlex.join(argv)}: exit {stop.code} before its parser accepted it:\n"
                        f"{err.getvalue()}")
    pytest.fail(f"diffexp {shlex.join(argv)}: returned without reaching an argparse parser; check it another way "
                "and list it in ELSEWHERE")


def substituted(argv: list[str]) -> list[str]:
    out = [PLACEHOLDERS.get(word, word) for word in argv]
    unknown = [word for word in out if word.startswith("$")]
    assert not unknown, f"{unknown}: add the variable to PLACEHOLDERS"
    return out


def check_command(argv: list[str]) -> str:
    """Exercise one simple command; what was done, or a test failure."""
    argv = substituted(argv)
    program = argv[0]
    if program == "diffexp":
        return parse_diffexp(argv[1:])
    if argv[:3] == ["python", "-m", "diffexp"]:
        return parse_diffexp(argv[3:])
    if argv[:2] == ["python", "cli.py"]:
        return parse_diffexp(argv[2:])
    if program == "srun":
        assert argv[1] == "diffexp", argv
        return parse_diffexp(argv[2:])
    if program == "torchrun":
        from torch.distributed.run import get_args_parser

        launch = get_args_parser().parse_args(argv[1:])
        assert launch.module and launch.training_script == "diffexp", f"torchrun runs {launch.training_script}"
        return parse_diffexp(launch.training_script_args)
    if program == "tensorboard":
        from tensorboard.program import TensorBoard

        TensorBoard().configure(argv=argv)  # parses the flags; starts no server
        return "parsed by TensorBoard"
    if program == "lm_eval":
        from lm_eval._cli import HarnessCLI

        cli = HarnessCLI()
        cli._parser.parse_args(argv[1:] if argv[1] in cli._subparsers.choices else ["run", *argv[1:]])
        return "parsed by lm_eval's parser"
    if program == "hf":
        import warnings

        from huggingface_hub.cli.hf import app

        context = app.make_context("hf", argv[1:])  # parses only: nothing is uploaded
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # click's protected_args, until click 9
            name, command, rest = app.resolve_command(context, [*context.protected_args, *context.args])
        command.make_context(name, rest, parent=context)
        return "parsed by the hf CLI"
    if program == "export":
        import importlib

        name = argv[1].split("=", 1)[0]
        assert name in ENV_VARS, f"export {name}: not a variable diffexp reads (ENV_VARS)"
        module, _, attribute = ENV_VARS[name].partition(":")
        assert getattr(importlib.import_module(module), attribute) == name
        return "a variable diffexp reads"
    pytest.fail(f"{shlex.join(argv)}: neither parsed here nor listed in ELSEWHERE with the test that runs it")


# --- the tests ---------------------------------------------------------------------------------------------

def test_the_readme_is_a_front_page():
    """About 150 lines, readable in five minutes; the figures' machines and commits are stated on the results
    pages and in bench/README.md, once per table, not on the front page."""
    text = README.read_text()
    assert len(text.splitlines()) <= 180, len(text.splitlines())
    commits = re.findall(r"\bcommit `?[0-9a-f]{7,40}\b|`[0-9a-f]{7,40}`", text)
    assert not commits, commits


def test_every_readme_code_block_names_its_language():
    """A command cannot hide in an unlabelled block: every block is a shell block or says what else it is."""
    for info, body in fenced_blocks(README.read_text()):
        assert info, f"a code block without a language: {body[:2]}"


def test_quick_start_is_three_commands_and_ci_runs_its_set_up_and_tests():
    text = README.read_text()
    quick = text[text.index("## Quick start"):]
    first = next(command_lines(body) for info, body in fenced_blocks(quick) if info in SHELL)
    assert len(first) == 3, first
    set_up, test, train = first
    ci = ci_lines()
    assert " ".join(set_up.split()) in ci, f"set-up command not in .ci/run: {set_up}"
    assert " ".join(test.split()) in ci, f"test command not in .ci/run: {test}"
    assert words(train)[:2] == ["diffexp", "fit"]


def test_readme_python_runs_as_shown(monkeypatch, tmp_path):
    """The README's Python block runs as written, from an empty directory: the tiny recipe's DIFF V1 (its
    parameter count, but for the byte vocabulary's end-of-document token), its logits and maps of the shapes
    the comments give, a loss near ln 256 at initialisation, and gradients in every weight."""
    [code] = [("\n".join(body)) for info, body in fenced_blocks(README.read_text()) if info == "python"]
    monkeypatch.chdir(tmp_path)
    namespace, out = {"__name__": "__main__"}, io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), namespace)
    model, logits, maps, loss = (namespace[name] for name in ("model", "logits", "maps", "loss"))
    assert model.cfg.attention == "diff_v1" and tuple(logits.shape) == (2, 64, 256)
    assert len(maps) == 4 and all(tuple(m.shape) == (2, 4, 64, 64) for m in maps)
    header = (REPO / "recipes/tiny/diff_v1.yaml").read_text()
    total = int(re.search(r"# parameters: total=(\d+)", header).group(1))
    extra_token = 2 * model.cfg.d_model  # the recipe's vocabulary is 257: one more embedding and lm_head row
    assert model.num_parameters() == total - extra_token
    assert abs(loss.item() - math.log(256)) < 0.5
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    printed = f"{model.num_parameters():,} parameters, loss {loss.item():.2f}, map (2, 4, 64, 64)"
    assert out.getvalue().startswith(printed)


def exercise(line: str) -> None:
    if " ".join(line.split()) in ci_lines():
        return  # .ci/run runs it, on every CI run
    key = " ".join(words(line))
    if key in ELSEWHERE:
        path, _, function = ELSEWHERE[key].partition("::")
        assert re.search(rf"^def {function}\(", (REPO / path).read_text(), re.M), ELSEWHERE[key]
        return
    for argv in simple_commands(line):
        check_command(argv)


@pytest.mark.parametrize("line", readme_commands())
def test_readme_command_is_exercised(line):
    exercise(line)


@pytest.mark.parametrize(("page", "line"), detail_commands())
def test_detail_page_command_is_exercised(page, line):
    exercise(line)


def test_elsewhere_lists_only_shown_commands():
    shown = {" ".join(words(line)) for page in PAGES for line in shown_commands(page)}
    assert set(ELSEWHERE) <= shown, set(ELSEWHERE) - shown


def test_heavy_tests_exist_and_stay_out_of_the_default_run():
    """`python -m pytest -q -m heavy` (README): the marker is declared, left out by default, and marks tests."""
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r"""addopts = .*-m 'not heavy'""", pyproject)
    assert '"heavy: ' in pyproject
    marked = [p.name for p in (REPO / "tests").glob("test_*.py") if "mark.heavy" in p.read_text()]
    assert len(marked) >= 3, marked


def test_a_command_outside_the_parsers_fails():
    """The checker itself: an unknown program is refused, a bad diffexp flag is caught by its parser."""
    with pytest.raises(pytest.fail.Exception):
        check_command(["rm", "-rf", "runs"])
    with pytest.raises(pytest.fail.Exception):
        check_command(["diffexp", "generate", "x.ckpt", "--no-such-flag"])
    from diffexp.errors import UserError

    with pytest.raises(UserError):  # LightningCLI's parser: an unknown key
        check_command(["diffexp", "fit", "--config", "recipes/tiny/diff_v1.yaml", "--model.arch.no_such_key", "1"])


# --- links and paths ---------------------------------------------------------------------------------------

def without_code_blocks(text: str) -> str:
    return re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.M | re.S)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but - and _ dropped, spaces to -,
    repeated ones numbered."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", without_code_blocks(page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_to_existing_files(page):
    text = without_code_blocks(page.read_text())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.relative_to(REPO)}: link to {target}: no such file"
        if anchor and file.suffix == ".md":
            assert anchor in anchors(file), f"{page.relative_to(REPO)}: link to {target}: no such heading"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_named_repository_files_exist(page):
    """A path such as `diffexp/model/decoder.py` in a page names a file (code moves; the pages follow)."""
    pattern = r"`((?:diffexp|tests|recipes|sweeps|bench)/[\w./-]+\.(?:py|cpp|yaml|md|sh))`"
    for path in re.findall(pattern, page.read_text()):
        assert (REPO / path).is_file(), f"{page.relative_to(REPO)} names {path}: no such file"


#: in a comment: a file of the repository, optionally with "#anchor", or followed by `, "Section title"`
POINTER = re.compile(r"\b((?:README|ARCHITECTURE)(?:\.md)?"
                     r"|(?:docs|bench|recipes|sweeps)/[\w./<>-]+\.(?:md|yaml|json|sh))(#[\w-]+)?(?:,\s+\"([^\"]+)\")?")


def comment_pointers(path: Path) -> list[tuple[str, str | None, str | None]]:
    """(file, #anchor, section title) of every pointer in the file's comments; a comment may run over lines."""
    comments = " ".join(line.split("#", 1)[1] if line.lstrip().startswith("#") else line.split(" # ", 1)[1]
                        for line in path.read_text().splitlines() if line.lstrip().startswith("#") or " # " in line)
    comments = re.sub(r"\s+", " ", comments)
    return [(m.group(1), m.group(2), m.group(3)) for m in POINTER.finditer(comments)]


def _pointer_problem(file: str, anchor: str | None, title: str | None) -> str | None:
    if "<" in file:  # a pattern such as recipes/gpu/variant/<variant>.yaml
        return None if list(REPO.glob(re.sub(r"<[^>]+>", "*", file))) else f"{file}: matches no file"
    path = REPO / (file if "." in Path(file).name else f"{file}.md")
    if not path.is_file():
        return f"{file}: no such file"
    if anchor and anchor[1:] not in anchors(path):
        return f"{file}{anchor}: no such heading"
    wanted = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-") if title else ""
    if title and path.suffix == ".md" and not any(a == wanted or a.startswith(wanted + "-")
                                                  for a in anchors(path)):  # a title's start names it too
        return f'{file}, "{title}": no such section'
    return None


@pytest.mark.parametrize("path", COMMENTED, ids=lambda p: str(p.relative_to(REPO)))
def test_every_pointer_in_a_recipe_or_spec_comment_resolves(path):
    problems = [problem for pointer in comment_pointers(path) if (problem := _pointer_problem(*pointer))]
    assert not problems, f"{path.relative_to(REPO)}: " + "; ".join(problems)


def test_the_pointer_check_finds_what_is_stale():
    """Each kind of stale pointer in a comment is caught: a missing file, heading or section."""
    assert _pointer_problem("README", None, "Data at paper scale") is not None
    assert _pointer_problem("README", None, "Quick start") is None
    assert _pointer_problem("docs/gpu.md", "#no-such-section", None) is not None
    assert comment_pointers(REPO / "recipes/gpu/base.yaml")


def test_the_paired_tiny_sweep_takes_one_time_wherever_it_is_stated():
    spec = (REPO / "sweeps/paired_tiny.yaml").read_text()
    stated = {re.search(r"about (\d+) min", spec).group(1)}
    readme = " ".join((REPO / "README.md").read_text().split())
    stated.add(re.search(r"`sweeps/paired_tiny.yaml`: [^)]*about (\d+) min", readme).group(1))
    results = " ".join((REPO / "docs/results/paired_tiny.md").read_text().split())
    stated.add(re.search(r"`sweeps/paired_tiny.yaml` \([^)]*about (\d+) min", results).group(1))
    table = (REPO / "docs/sweeps.md").read_text().splitlines()
    row = next(line for line in table if "`sweeps/paired_tiny.yaml`" in line)
    stated.add(re.search(r"about (\d+) min", row).group(1))
    assert len(stated) == 1, stated
