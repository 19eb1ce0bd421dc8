"""What a bench run records and prints: the environment, the results JSON, the rich table and the
comparison with an earlier run of the same kind."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from diffexp.bench.timing import EARLIER_RATIO_ESTIMATOR
from diffexp.errors import UserError

PACKAGE_DIR = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------------
# environment
# --------------------------------------------------------------------------------------------------
def git_info() -> dict:
    """Commit and dirty flag of the diffexp source being measured (None outside a git checkout)."""
    def git(*cmd: str) -> str | None:
        try:
            out = subprocess.run(["git", *cmd], cwd=PACKAGE_DIR, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def loadavg() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _own_ticks() -> int:
    """CPU ticks of this process and its descendants (the compiler processes torch.compile starts), the children
    they have waited for included, from /proc/<pid>/stat."""
    parents, ticks = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        parents[int(entry)] = int(fields[1])
        ticks[int(entry)] = sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
    tree, grown = {os.getpid()}, True
    while grown:
        found = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree, grown = tree | found, bool(found)
    return sum(ticks.get(pid, 0) for pid in tree)


def cpu_seconds() -> dict | None:
    """The machine's busy CPU seconds so far (all CPUs, time stolen by the hypervisor included) and those of this
    process and its descendants, from /proc (None where there is none). Their difference over a run is what other
    processes took, which the load average cannot tell from the run's own threads and compilers."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
        tick = os.sysconf("SC_CLK_TCK")
        own = _own_ticks()
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return {"busy": (sum(fields[:8]) - idle) / tick, "own": own / tick}


def others_share(start: dict | None, end: dict | None, wall_s: float, cpus: int | None) -> float | None:
    """The share of the machine's CPU time other processes used between `start` and `end` (cpu_seconds)."""
    if not start or not end or wall_s <= 0 or not cpus:
        return None
    others = (end["busy"] - start["busy"]) - (end["own"] - start["own"])
    return max(0.0, others) / (wall_s * cpus)


def environment(device: str) -> dict:
    import torch

    env = {
        "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "device": device, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "git": git_info(), "loadavg_start": loadavg(), "cpu_seconds_start": cpu_seconds(),
    }
    if device == "cuda":
        env["device_name"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    else:
        env["device_name"] = cpu_name()
    return env


def cpu_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model ("AMD EPYC 7B13"): the machines a run lands on differ, and their figures with them. Where
    the system does not say, the architecture."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def recorded_run(device: str, threads: int | None, run: Callable[[], dict],
                 on_start: Callable[[dict], None] = lambda env: None) -> tuple[dict, dict]:
    """(environment, results) of `run()` under `threads` torch threads (None: torch's default), the environment
    completed with the load average, thread count and wall time at its end; on_start gets it as it is at the start."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    env = environment(device)
    on_start(dict(env))
    started = time.perf_counter()
    results = run()
    env["loadavg_end"] = loadavg()
    env["cpu_seconds_end"] = cpu_seconds()
    # the count the whole run used: a library that resets torch's threads mid-run would show here
    env["threads_end"] = torch.get_num_threads()
    wall_s = time.perf_counter() - started
    env["wall_s"] = round(wall_s, 1)
    env["others_cpu_share"] = others_share(env["cpu_seconds_start"], env["cpu_seconds_end"], wall_s, env["cpu_count"])
    return env, results


def peak_flops(device: str, dtype: str, peak_tflops: float | None) -> float | None:
    """Peak FLOP/s for MFU: --peak-tflops, else the GPU's at the dtype (None on CPU)."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
    import torch

    from diffexp.gpu_peaks import peak_flops as device_peak

    return device_peak(torch.device(device), torch.bfloat16 if dtype == "bf16" else torch.float32)


OTHERS_SHARE_NOTED = 0.05  # a shell, the OS and a few daemons take about 1%


def load_note(env: dict) -> str:
    """Caption lines when other processes competed for the CPUs, or torch's thread count changed mid-run."""
    note = ""
    if env.get("threads_end", env.get("threads")) != env.get("threads"):
        note += f"\nNOTE: torch's thread count changed during the run: {env['threads']} -> {env['threads_end']}."
    share = env.get("others_cpu_share")
    if share is not None:
        if share <= OTHERS_SHARE_NOTED:
            return note
        return note + (f"\nNOTE: other processes took {share:.0%} of the {env['cpu_count']} CPUs' time during the run: "
                       "trust ratios only within their spread.")
    start, end = env.get("loadavg_start"), env.get("loadavg_end")  # no /proc/stat: the load, the run's own included
    if not start or not end or max(start[0], end[0]) <= (env.get("cpu_count") or 1):
        return note
    return note + (f"\nNOTE: load average {start[0]:.1f} -> {end[0]:.1f} on {env['cpu_count']} CPUs: other "
                   "processes competed; trust ratios only within their spread.")


# --------------------------------------------------------------------------------------------------
# results JSON
# --------------------------------------------------------------------------------------------------
def write_results(path: Path, data: dict) -> None:
    """Written whole or not at all: a run stopped mid-write leaves the previous file."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_text(json.dumps(data, indent=1))
        os.replace(partial, path)
    except OSError:
        partial.unlink(missing_ok=True)
        raise


def load_results(path: Path, kind: str) -> dict:
    """An earlier run of `diffexp bench KIND` (a JSON without "kind" is a training-step run); UserError if not."""
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or "results" not in data or "config" not in data:
            raise ValueError("not a diffexp bench result (no 'results'/'config')")
    except (OSError, ValueError) as err:
        raise UserError(f"--compare {path}: cannot read an earlier result: {err}") from None
    if data.get("complete") is False:
        raise UserError(f"--compare {path}: an unfinished run (it stopped after the shapes it lists, and its ratios "
                        "are computed at the end); compare with a finished run")
    found = data.get("kind", "train")
    if found != kind:
        raise UserError(f"--compare {path}: a `diffexp bench {found}` result; expected the JSON of a "
                        f"`diffexp bench {kind}` run")
    return data


# --------------------------------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------------------------------
def ratio_cell(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def spread_cell(entry: dict, ratio: str) -> str:
    low, high = entry.get(f"{ratio}_min"), entry.get(f"{ratio}_max")
    return "n/a" if low is None or high is None else f"{low:.2f}-{high:.2f}"


def mib_cell(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.1f}"


def tflops_text(flops_per_s: float | None) -> str:
    return "n/a" if not flops_per_s else f"{flops_per_s / 1e12:g}"


def print_table(title: str, headers: list[str], rows: list[list[str]], caption: str = "",
                group_columns: tuple[int, ...] = (1,)) -> None:
    """A rich table (plain text without rich), a new section whenever the group columns change."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        print(title)
        print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
        print("  ".join("-" * w for w in widths))
        for row in rows:
            print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if caption:
            print(caption)
        return
    table = Table(title=title, caption=caption, caption_justify="left")
    # cells are never cut: each column is as wide as its widest cell (or its header up to 16 characters,
    # or the header's longest word); a longer header wraps to that width, and the console is as wide as the table needs
    for i, h in enumerate(headers):
        width = max([len(r[i]) for r in rows] + [len(word) for word in h.split()] + [min(len(h), 16)])
        table.add_column("\n".join(textwrap.wrap(h, width)), justify="left" if i == 0 else "right", no_wrap=True,
                         vertical="bottom")
    previous = None
    for row in rows:
        group = [row[i] for i in group_columns]
        if previous is not None and group != previous:
            table.add_section()
        previous = group
        table.add_row(*row)
    needed = Console(width=10_000).measure(table).maximum
    Console(file=sys.stdout, width=max(140, Console().width, needed), highlight=False).print(table)


# --------------------------------------------------------------------------------------------------
# --compare
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ratio:
    """One ratio column group of the --compare table: old, new, change (and the old run's spread)."""

    key: str
    old: str
    new: str
    change: str
    spread: str | None = None


@dataclass(frozen=True)
class Layout:
    """How a kind's results are labelled and compared with an earlier run."""

    labels: tuple[tuple[str, str], ...]  # (header, entry key) of the columns that name a row
    ratios: tuple[Ratio, ...]
    config_keys: tuple[str, ...]  # settings whose change makes the runs not comparable


ENV_KEYS = ("device", "device_name", "threads", "torch")


def _change_cell(a: float | None, b: float | None) -> str:
    return "n/a" if not a or b is None else f"{(b / a - 1) * 100:+.1f}%"


def compare(old: dict, new: dict, layout: Layout, compare_path: Path) -> None:
    """Ratio changes between an earlier run and this one, per result key present in both."""
    diffs = [f"{k}: {old['env'].get(k)} -> {new['env'].get(k)}" for k in ENV_KEYS
             if old["env"].get(k) != new["env"].get(k)]
    estimators = [run["config"].get("ratio_estimator", EARLIER_RATIO_ESTIMATOR) for run in (old, new)]
    if estimators[0] != estimators[1]:
        diffs.append(f"ratio_estimator: {estimators[0]} -> {estimators[1]}")
    for k in layout.config_keys:
        a, b = old["config"].get(k), new["config"].get(k)
        if isinstance(a, dict) and isinstance(b, dict):  # per variant: only the variants both runs measured
            a, b = ({v: d[v] for v in a.keys() & b.keys()} for d in (a, b))
        if a != b:
            diffs.append(f"{k}: {a} -> {b}")
    rows = []
    for key, entry in new["results"].items():
        old_entry = old["results"].get(key)
        if old_entry is None:
            continue
        if old_entry.get("batch_size") != entry["batch_size"]:
            diffs.append(f"batch at seq {entry['seq_len']}: {old_entry.get('batch_size')} -> {entry['batch_size']}")
        row = [str(entry[field]) for _, field in layout.labels]
        for ratio in layout.ratios:
            before, after = old_entry.get(ratio.key), entry.get(ratio.key)
            row += [ratio_cell(before), ratio_cell(after), _change_cell(before, after)]
            if ratio.spread:
                row.append(spread_cell(old_entry, ratio.key))
        rows.append(row)
    if not rows:
        print(f"\n--compare: no result in common with {compare_path}")
        return
    headers = [header for header, _ in layout.labels]
    for ratio in layout.ratios:
        headers += [ratio.old, ratio.new, ratio.change] + ([ratio.spread] if ratio.spread else [])
    commit = (old["env"].get("git") or {}).get("commit") or "?"
    caption = "A ratio change inside the old run's spread is noise, not a regression."
    if diffs:
        caption += "\nWARNING, the runs differ in: " + "; ".join(dict.fromkeys(diffs))
    print()
    print_table(f"Change vs {compare_path} (commit {commit[:10]}, {old.get('created')})", headers, rows, caption,
                group_columns=tuple(range(1, len(layout.labels))))


#: the profile table's cut of a kernel's name; the JSON keeps it whole
PROFILE_NAME_WIDTH = 70


def _shortened(name: str) -> str:
    """A long name cut in the middle: inductor's kernel names differ in their last characters."""
    if len(name) <= PROFILE_NAME_WIDTH:
        return name
    tail = PROFILE_NAME_WIDTH // 3
    return name[: PROFILE_NAME_WIDTH - tail - 3] + "..." + name[-tail:]


def print_profiles(data: dict, labels: tuple[tuple[str, str], ...]) -> None:
    """One table of every profiled result's top entries, under the results table."""
    rows = []
    for entry in data["results"].values():
        prof = entry.get("profile")
        if not prof:
            continue
        cells = [str(entry.get(key, "")) for _, key in labels]
        for item in prof["top"]:
            name = _shortened(item["name"])
            rows.append([*cells, name, f"{item['calls']:g}", f"{item['self_us']:.1f}",
                         f"{item['self_us'] / prof['total_us']:.0%}"])
    if not rows:
        return
    first = next(e["profile"] for e in data["results"].values() if e.get("profile"))
    unit, clock = first["unit"], first["clock"]
    where = "GPU kernel time" if clock == "gpu" else "host time on the calling thread"
    caption = (f"One run of each after the timed rounds, under torch.profiler: the operations and kernels with the "
               f"most self time ({where}), per {unit}; share = of all self time profiled. Under the profiler a "
               "run is slower than timed, most in the smallest operations. The whole names are in the results "
               "JSON (\"profile\").")
    headers = [header for header, _ in labels] + ["operation or kernel", f"calls/{unit}", f"us/{unit}", "share"]
    print()
    print_table(f"Where the time goes (--profile {data['config'].get('profile')})", headers, rows, caption,
                group_columns=tuple(range(len(labels))))
