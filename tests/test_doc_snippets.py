"""The code of the README and the documentation pages runs, and the output they show is what
a real run prints.

The Usage example (in the README and in ``docs/getting-started.md``, the same code) is run as
written, twice (in a temporary working directory, so its relative ``runs/demo`` lands there):
the second run resumes. The quickstart is run the way the getting-started page runs it, with
one process and half the samples instead of two processes: the same 64 optimizer steps per
epoch, so the checkpoint names, epochs, steps and ``accelkit ckpt ls`` columns must match the
page exactly; only losses, speeds, sizes, ages and checksums (and file counts, one
``random_states`` pair fewer) differ, and are masked. The same run then goes through the
checkpoints guide's walk-through (an incomplete save, a damaged file, ``accelkit ckpt verify /
prune / inspect`` from the CLI guide, the run that resumes past the damaged checkpoint), taking
its steps from the pages' text and commands. Every other Python block of the pages is at least
valid Python.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from accelkit.cli._table import format_runs
from accelkit.trackers.backends.jsonl import read_jsonl
from tests.helpers.preloaded import JOB_MODULES, Preloaded

ROOT = Path(__file__).resolve().parents[1]
# The README and every page of the documentation site, by path.
PAGES = {
    str(path.relative_to(ROOT)): path.read_text(encoding="utf-8")
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
}
DOCS = "\n".join(PAGES.values())

# Per process 2048 samples / batch 32 = 64 steps, as the page's 4096 samples on 2 processes.
ONE_PROCESS = ["--samples", "2048"]


def _fenced(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)


def _block(containing: str, language: str | None = None) -> str:
    """The first fenced block of the README or a documentation page containing
    ``containing``."""
    for lang, body in _fenced(DOCS):
        if containing in body and (language is None or lang == language):
            return body
    raise AssertionError(f"no page has a code block containing {containing!r}")


def _console(body: str) -> list[tuple[str, list[str]]]:
    """``(command, output lines)`` of each ``$ command`` in a console block."""
    steps: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            steps[-1][1].append(line)
    return steps


def _mask(line: str) -> str:
    """A line with what changes from run to run blanked out: losses, speeds, durations, sizes
    and checksums (also what differs with one process instead of two: file and byte counts, and
    so the width of a table's size column)."""
    line = re.sub(r"\d+(\.\d+)?(it/s|s/it)", "<rate>", line)
    line = re.sub(r"\d\d:\d\d<\d\d:\d\d", "<time>", line)
    line = re.sub(r"xxh3_128:[0-9a-f]+", "<checksum>", line)
    line = re.sub(r"\d+ files", "<n> files", line)
    line = re.sub(r"\(\d+ bytes\)", "(<n> bytes)", line)
    line = re.sub(r"\d+\.\d+", "<float>", line)
    return re.sub(r" +", " ", line)


def _masked(lines: list[str]) -> list[str]:
    return [_mask(line) for line in lines if line.strip()]


@pytest.fixture(scope="module")
def python() -> Iterator[Preloaded]:
    """Fresh processes for the examples' runs and the pages' ``accelkit`` commands, each forked
    from one that imported torch and accelkit once (``tests.helpers.preloaded``): what is tested
    is what a run does and prints, not how its interpreter starts, and each of the module's 14
    runs paid 2.5-3.5 s of CPU importing torch. On the CPU, as every test not marked cuda."""
    with Preloaded(list(JOB_MODULES), env={**os.environ, "ACCELKIT_USE_CPU": "1"}) as preloaded:
        yield preloaded


def _run(
    python: Preloaded, args: list[str], cwd: Path, expect: int = 0
) -> subprocess.CompletedProcess[str]:
    """``python *args`` in ``cwd`` (a script by its absolute path, as ``python script.py``
    names it in tracebacks and warnings), its output decoded."""
    done = python.run(*args, cwd=cwd, timeout=240)
    proc = subprocess.CompletedProcess(
        done.args, done.returncode, done.stdout.decode(errors="replace"),
        done.stderr.decode(errors="replace"),
    )  # fmt: skip
    output = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == expect, f"{args} exited {proc.returncode}, not {expect}:\n{output}"
    return proc


class Run(NamedTuple):
    """What a quickstart run printed: stdout lines, each progress bar's last drawing, stderr."""

    printed: list[str]
    bars: list[str]
    stderr: str


def _quickstart(python: Preloaded, cwd: Path, readme_command: str, expect: int = 0) -> Run:
    """Run the page's quickstart command, with one process for two (see ``ONE_PROCESS``)."""
    args = shlex.split(readme_command)
    script = next(i for i, a in enumerate(args) if a.endswith("examples/quickstart.py"))
    example = str(ROOT / "examples" / "quickstart.py")
    proc = _run(python, [example, *args[script + 1 :], *ONE_PROCESS], cwd, expect)
    # tqdm redraws with "\r"; keep each bar's last drawing, as the pages show them.
    bars: dict[str, str] = {}
    for piece in re.split(r"[\r\n]", proc.stderr):
        match = re.match(r"(epoch \d+/\d+): ", piece)
        if match:
            bars[match.group(1)] = piece.rstrip()
    return Run(proc.stdout.splitlines(), list(bars.values()), proc.stderr)


def _accelkit(
    python: Preloaded, cwd: Path, readme_command: str, expect: int = 0
) -> subprocess.CompletedProcess[str]:
    """Run a page's ``.venv/bin/accelkit ...`` command (a ``| head`` after it left off)."""
    args = shlex.split(readme_command.split("|")[0])
    assert args[0].endswith("accelkit"), readme_command
    return _run(python, ["-m", "accelkit.cli.main", *args[1:]], cwd, expect)


def _split_output(lines: list[str]) -> tuple[list[str], list[str]]:
    """A page's output lines as (printed lines, progress bars)."""
    bars = [line for line in lines if re.match(r"epoch \d+/\d+: ", line)]
    return [line for line in lines if line and line not in bars], bars


def _assert_same_run(run: Run, shown_lines: list[str]) -> None:
    shown, shown_bars = _split_output(shown_lines)
    assert _masked(run.printed) == _masked(shown)
    if shown_bars:
        assert _masked(run.bars) == _masked(shown_bars)


_LS_ROW = re.compile(
    r"(?P<NAME>\S+)\s+(?P<STATE>\S+)\s+(?P<ITER>\S+)\s+(?P<STEP>\S+)\s+(?P<SIZE>\S+ \S+)"
    r"\s+(?P<FILES>\S+)\s+(?P<AGE>\S+)\s+(?P<REASON>\S+)\s+(?P<RUNS>\S+)\s+(?P<METRICS>\S+)"
    r"\s+(?P<RESUMED>\S+)"
)


def _ls_rows(text: str) -> tuple[str, list[dict[str, str]]]:
    """The header and rows of an ``accelkit ckpt ls`` table."""
    header, *lines = [line for line in text.splitlines() if line.strip()]
    assert header.split() == list(_LS_ROW.groupindex), header
    rows = []
    for line in lines:
        match = _LS_ROW.fullmatch(line.strip())
        assert match, f"not an `accelkit ckpt ls` row: {line!r}"
        rows.append(match.groupdict())
    return header, rows


EXAMPLE_MARK = "accelerator.register_for_checkpointing(progress)"


def _usage_examples() -> dict[str, str]:
    """The Usage example of each page that shows it, by page."""
    found = {
        page: body
        for page, text in PAGES.items()
        for lang, body in _fenced(text)
        if lang == "python" and EXAMPLE_MARK in body
    }
    assert {"README.md", "docs/getting-started.md"} <= set(found), sorted(found)
    return found


def _logged(logs: Path) -> tuple[list[int], list[int], list[str]]:
    """TensorBoard's and ``metrics.jsonl``'s steps of ``loss``, and the checkpoints saved."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logs))
    events.Reload()
    tensorboard = [event.step for event in events.Scalars("loss")]
    jsonl = [r["step"] for r in read_jsonl(str(logs / "metrics.jsonl"), metrics_only=True)]
    saves = [
        r["path"].rsplit("/", 1)[-1]
        for r in read_jsonl(str(logs / "metrics.jsonl"))
        if r.get("event") == "checkpoint_save"
    ]
    return tensorboard, jsonl, saves


@pytest.mark.slow  # three short training runs in fresh interpreters: about 10 s
def test_usage_example_runs_and_a_second_run_resumes(python: Preloaded, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the Usage example logs to TensorBoard")
    examples = _usage_examples()
    assert len(set(examples.values())) == 1, f"the pages show different examples: {examples}"
    code = examples["README.md"]
    (tmp_path / "train.py").write_text(code)
    checkpoints = tmp_path / "runs" / "demo" / "checkpoints"
    logs = tmp_path / "runs" / "demo" / "demo"

    # What the example's comments promise: one committed checkpoint per epoch, newest 3 kept.
    _run(python, [str(tmp_path / "train.py")], tmp_path)
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"checkpoint_{i}" for i in range(3)]
    manifest = json.loads((checkpoints / "checkpoint_2" / "accelkit.json").read_text())
    assert manifest["step"] == 3 * 16  # 512 samples / batch 32, 3 epochs of optimizer steps
    # Every logged point has its own, increasing step (not all at step 0).
    assert _logged(logs) == (list(range(1, 49)), list(range(1, 49)), _names(0, 3))

    # Run again: it resumes (no `checkpoint_0 already exists`), counts on, logs each step once.
    second = _run(python, [str(tmp_path / "train.py")], tmp_path)
    assert "Traceback" not in second.stderr and "Warning" not in second.stderr, second.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == _names(3, 6)
    manifest = json.loads((checkpoints / "checkpoint_5" / "accelkit.json").read_text())
    assert manifest["step"] == 6 * 16
    assert _logged(logs) == (list(range(1, 97)), list(range(1, 97)), _names(0, 6))

    # Without its load_state() line, a third run is warned, once, at its backward() line, as
    # the getting-started page shows.
    resume = next(line for line in code.splitlines() if "accelerator.load_state()" in line)
    forgetful = code.replace(resume, "    pass")
    (tmp_path / "train.py").write_text(forgetful)
    third = _run(python, [str(tmp_path / "train.py")], tmp_path)
    warned = [line for line in third.stderr.splitlines() if "UnresumedProjectWarning" in line]
    shown = _block("UnresumedProjectWarning: runs/demo").strip()
    backward = 1 + forgetful.splitlines().index("        accelerator.backward(loss)")
    assert len(warned) == 1 and warned[0].endswith(shown.split(":", 1)[1]), third.stderr
    assert warned[0].startswith(f"{tmp_path / 'train.py'}:{backward}: ")
    assert shown.startswith(f"train.py:{backward}: ")


def _names(start: int, stop: int) -> list[str]:
    return [f"checkpoint_{i}" for i in range(start, stop)]


def _python_blocks() -> list[tuple[str, str]]:
    return [
        (page, body)
        for page, text in PAGES.items()
        for lang, body in _fenced(text)
        if lang == "python"
    ]


@pytest.mark.parametrize(("page", "code"), _python_blocks(), ids=lambda v: v[:40])
def test_every_python_block_is_valid_python(page: str, code: str) -> None:
    """A block that is not a whole program (``...`` for the rest, names defined elsewhere) is
    at least Python that parses, so a renamed argument or a typo shows up here."""
    compile(code, page, "exec")


def test_the_storage_guides_configuration_builds() -> None:
    """The S3 configuration of the storage guide is a valid ``ProjectConfiguration`` (its
    names as the guide writes them; nothing is contacted until a save)."""
    code = _block('project_dir="s3://my-bucket/runs/run-7"', "python")
    namespace: dict[str, Any] = {}
    exec(
        compile("from accelkit import ProjectConfiguration\n" + code, "storage.md", "exec"),
        namespace,
    )
    config = namespace["config"]
    assert config.project_dir == "s3://my-bucket/runs/run-7" and config.total_limit == 3
    assert config.storage_options == {"endpoint_url": "http://127.0.0.1:8333"}


def _assert_ls_matches(listing: str, shown: list[str], project: Path) -> None:
    """``accelkit ckpt ls`` printed the page's rows, and its columns say what manifests say."""
    header, rows = _ls_rows(listing)
    shown_header, shown_rows = _ls_rows("\n".join(shown))
    assert header.split() == shown_header.split()
    same = ("NAME", "STATE", "ITER", "STEP", "RESUMED")  # FILES, SIZE differ with one process
    assert [{k: r[k] for k in same} for r in rows] == [{k: r[k] for k in same} for r in shown_rows]
    for row in rows:
        folder = project / "checkpoints" / row["NAME"]
        if row["STATE"] != "committed":
            assert not (folder / "accelkit.json").exists() and row["STEP"] == "-"
            continue
        manifest = json.loads((folder / "accelkit.json").read_text())
        assert int(row["STEP"]) == manifest["step"]
        assert int(row["ITER"]) == manifest["iteration"]
        assert int(row["FILES"]) == len(manifest["files"]) + 1  # + the manifest itself
        assert row["RUNS"] == format_runs(manifest.get("experiment"))
        name, value = row["METRICS"].split("=")
        assert float(value) == pytest.approx(manifest["metrics"][name], rel=1e-5)
        resumed = manifest["experiment"]["resumed"]  # each shown run resumed from the second
        assert row["RESUMED"] == f"{resumed['tier']}:{resumed['checkpoint']}"
        # seconds, or minutes on a loaded machine (the module's fixture ran the job earlier)
        assert re.fullmatch(r"\d+[sm]", row["AGE"])
        assert re.fullmatch(r"[\d.]+ [KMG]?i?B", row["SIZE"])


def _manifests(cwd: Path) -> dict[str, str]:
    """Each checkpoint's manifest text, by checkpoint name."""
    return {
        p.parent.name: p.read_text()
        for p in cwd.glob("runs/quickstart/checkpoints/*/accelkit.json")
    }


def _ls_project(manifests: dict[str, str], project: Path) -> Path:
    """A project folder holding ``manifests`` as they were when ``ls`` ran."""
    for name, text in manifests.items():
        (project / "checkpoints" / name).mkdir(parents=True)
        (project / "checkpoints" / name / "accelkit.json").write_text(text)
    return project


class Walk(NamedTuple):
    """A quickstart walk-through in ``cwd``: each step's output, by name."""

    cwd: Path
    out: dict[str, Any]


@pytest.fixture(scope="module")
def quickstart(python: Preloaded, tmp_path_factory: pytest.TempPathFactory) -> Walk:
    """The getting-started page's quickstart: the first run, the run that resumes, and
    ``accelkit ckpt ls``."""
    cwd = tmp_path_factory.mktemp("quickstart")
    main_job = next(b for lang, b in _fenced(DOCS) if lang == "bash" and "quickstart.py" in b)
    first_command = main_job.strip().split(" && ")[-1]
    # ONE_PROCESS stands for the page's two processes on the default dataset.
    assert "--num_processes 2" in first_command and "--samples" not in first_command
    (resume_command, _), (ls_command, _) = _console(_block("--epochs 5", "console"))
    out: dict[str, Any] = {
        "first": _quickstart(python, cwd, first_command),
        "resume": _quickstart(python, cwd, resume_command),
        "ls": _accelkit(python, cwd, ls_command).stdout,
    }
    # Later steps change the folder: keep what `ls` was checked against.
    out["ls_manifests"] = _manifests(cwd)
    return Walk(cwd, out)


@pytest.mark.slow  # two training runs in fresh interpreters: about 10 s on an idle machine
def test_quickstart_output_is_what_a_run_prints(quickstart: Walk, tmp_path: Path) -> None:
    _assert_same_run(quickstart.out["first"], _block("done: 3 epochs").splitlines())
    # "Run it again and it resumes": the resume command's output, then `ckpt ls`.
    (_, resume_out), (ls_command, ls_out) = _console(_block("--epochs 5", "console"))
    _assert_same_run(quickstart.out["resume"], resume_out)
    project = tmp_path / shlex.split(ls_command)[-1]  # the manifests `ls` saw, as files
    _ls_project(quickstart.out["ls_manifests"], project)
    _assert_ls_matches(quickstart.out["ls"], ls_out, project)


@pytest.fixture(scope="module")
def damaged(python: Preloaded, quickstart: Walk) -> Walk:
    """The Checkpoints section's walk-through, after the quickstart's two runs: a third run,
    its manifest removed, ``ls``, a run that resumes past it, a damaged file, ``accelkit ckpt
    verify / prune / inspect`` on it, and the run that warns and resumes past it."""
    cwd, out = quickstart.cwd, {}
    third = re.search(r"a third run \(`(--epochs \d+)`\)", DOCS)
    removed = re.search(r"`rm (runs/quickstart/checkpoints/checkpoint_\d+/accelkit\.json)`", DOCS)
    assert third and removed, (
        "the checkpoints guide no longer describes how the incomplete save was made"
    )
    _quickstart(python, cwd, f"examples/quickstart.py {third.group(1)}")
    (cwd / removed.group(1)).unlink()
    (ls_command, _), (resume_command, _) = _console(_block("checkpoint_5  incomplete", "console"))
    out["ls"] = _accelkit(python, cwd, ls_command).stdout
    out["ls_manifests"] = _manifests(cwd)  # retention removes some of them later
    out["resume"] = _quickstart(python, cwd, resume_command)

    flipped = re.search(r"byte of `(checkpoint_\d+/model\.safetensors)` flipped", DOCS)
    assert flipped, "the checkpoints guide no longer describes how the file was damaged"
    damaged_file = cwd / "runs" / "quickstart" / "checkpoints" / flipped.group(1)
    data = bytearray(damaged_file.read_bytes())
    data[-1] ^= 0xFF
    damaged_file.write_bytes(bytes(data))

    # The `accelkit ckpt` section shows the folder before the run that resumes past the damage.
    for command, _ in _console(_block("ckpt verify runs/quickstart", "console")):
        if command.startswith("echo"):
            continue
        expect = 1 if " verify " in command else 0
        proc = _accelkit(python, cwd, command, expect)
        out[shlex.split(command)[2]] = proc.stdout.splitlines() + proc.stderr.splitlines()

    [(skip_command, _)] = _console(_block("Not resuming from", "console"))
    out["skipped"] = _quickstart(python, cwd, skip_command)
    return Walk(cwd, out)


@pytest.mark.slow
def test_incomplete_checkpoint_walkthrough_is_what_a_run_prints(
    damaged: Walk, tmp_path: Path
) -> None:
    (_, ls_out), (_, resume_out) = _console(_block("checkpoint_5  incomplete", "console"))
    project = _ls_project(damaged.out["ls_manifests"], tmp_path / "project")
    _assert_ls_matches(damaged.out["ls"], ls_out, project)
    _assert_same_run(damaged.out["resume"], resume_out)


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_skipped_as_the_readme_shows(damaged: Walk) -> None:
    [(_, shown)] = _console(_block("Not resuming from", "console"))
    warnings = [line for line in shown if line.startswith("Not resuming from")]
    assert len(warnings) == 1  # one per process: one here, with one process
    assert _mask(warnings[0]) in _masked(damaged.out["skipped"].stderr.splitlines())
    _assert_same_run(damaged.out["skipped"], [line for line in shown if line not in warnings])


@pytest.mark.slow
def test_ckpt_commands_print_what_the_readme_shows(damaged: Walk) -> None:
    steps = _console(_block("ckpt verify runs/quickstart", "console"))
    for command, shown in steps:
        if command.startswith("echo"):  # `echo $?` after verify: its exit code, checked above
            assert shown == ["1"]
            continue
        printed = damaged.out[shlex.split(command)[2]]
        if "| head -" in command:
            printed = printed[: int(command.rsplit("-", 1)[1])]
        assert _masked(printed) == _masked(shown), command
