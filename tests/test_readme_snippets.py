"""The README's code runs, and the output it shows is what a real run prints.

The Usage snippet is run as written (in a temporary working directory, so its relative
``runs/demo`` lands there). The quickstart is run the way the README runs it, with one process
and half the samples instead of two processes: the same 64 optimizer steps per epoch, so the
checkpoint names, epochs, steps and ``accelkit ckpt ls`` columns must match the README exactly;
only losses, speeds, sizes and ages (and ``FILES``, one ``random_states`` pair fewer) differ.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")

# Per process 2048 samples / batch 32 = 64 steps, as the README's 4096 samples on 2 processes.
ONE_PROCESS = ["--samples", "2048"]


def _fenced(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)


def _block(containing: str, language: str | None = None) -> str:
    """The first fenced block of the README containing ``containing``."""
    for lang, body in _fenced(README):
        if containing in body and (language is None or lang == language):
            return body
    raise AssertionError(f"README.md has no code block containing {containing!r}")


def _section(title: str) -> str:
    """The README's text from the heading ``## title`` to the next ``## `` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", README, re.S | re.M)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


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
    """A line with what changes from run to run (losses, speeds, durations) blanked out."""
    line = re.sub(r"\d+(\.\d+)?(it/s|s/it)", "<rate>", line)
    line = re.sub(r"\d\d:\d\d<\d\d:\d\d", "<time>", line)
    return re.sub(r"\d+\.\d+", "<float>", line)


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _quickstart(cwd: Path, readme_command: str) -> tuple[list[str], list[str]]:
    """Run the README's quickstart command with one process: (stdout lines, final bars)."""
    args = shlex.split(readme_command)
    script = next(i for i, a in enumerate(args) if a.endswith("examples/quickstart.py"))
    proc = _run(
        [
            sys.executable,
            str(ROOT / "examples" / "quickstart.py"),
            *args[script + 1 :],
            *ONE_PROCESS,
        ],
        cwd,
    )
    # tqdm redraws with "\r"; keep each bar's last drawing, as the README shows them.
    bars: dict[str, str] = {}
    for piece in re.split(r"[\r\n]", proc.stderr):
        match = re.match(r"(epoch \d+/\d+): ", piece)
        if match:
            bars[match.group(1)] = piece.rstrip()
    return proc.stdout.splitlines(), list(bars.values())


def _split_output(lines: list[str]) -> tuple[list[str], list[str]]:
    """README output lines as (printed lines, progress bars)."""
    bars = [line for line in lines if re.match(r"epoch \d+/\d+: ", line)]
    return [line for line in lines if line and line not in bars], bars


_LS_ROW = re.compile(
    r"(?P<NAME>\S+)\s+(?P<STATE>\S+)\s+(?P<ITER>\S+)\s+(?P<STEP>\S+)\s+(?P<SIZE>\S+ \S+)"
    r"\s+(?P<FILES>\S+)\s+(?P<AGE>\S+)\s+(?P<METRICS>.+)"
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


def test_usage_snippet_commits_checkpoints_and_logs_increasing_steps(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the Usage snippet logs to TensorBoard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    snippet = re.search(r"```python\n(.*?)```", _section("Usage"), re.S)
    assert snippet, "README.md's Usage section has no python block"
    (tmp_path / "train.py").write_text(snippet.group(1))
    _run([sys.executable, "train.py"], tmp_path)

    # What the snippet's comments promise: one committed checkpoint per epoch, newest 3 kept.
    checkpoints = tmp_path / "runs" / "demo" / "checkpoints"
    names = sorted(p.name for p in checkpoints.iterdir())
    assert names == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    manifest = json.loads((checkpoints / "checkpoint_2" / "accelkit.json").read_text())
    assert manifest["step"] == 3 * 16  # 512 samples / batch 32, 3 epochs of optimizer steps

    # Every logged point has its own, increasing step in TensorBoard (not all at step 0).
    logs = tmp_path / "runs" / "demo" / "demo"
    events = EventAccumulator(str(logs))
    events.Reload()
    steps = [event.step for event in events.Scalars("loss")]
    assert steps == list(range(1, 49))
    records = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == steps


@pytest.mark.slow  # two training runs in fresh interpreters: about 10 s
def test_quickstart_output_is_what_a_run_prints(tmp_path: Path) -> None:
    # The main job's command and its shown output.
    main_job = next(b for lang, b in _fenced(README) if lang == "bash" and "quickstart.py" in b)
    first_command = main_job.strip().split(" && ")[-1]
    # ONE_PROCESS stands for the README's two processes on the default dataset.
    assert "--num_processes 2" in first_command and "--samples" not in first_command
    shown, shown_bars = _split_output(_block("done: 3 epochs").splitlines())
    printed, bars = _quickstart(tmp_path, first_command)
    assert [_mask(line) for line in printed] == [_mask(line) for line in shown]
    assert [_mask(line) for line in bars] == [_mask(line) for line in shown_bars]

    # "Run it again and it resumes": the resume command, its output, then `ckpt ls`.
    (resume_command, resume_out), (ls_command, ls_out) = _console(_block("--epochs 5", "console"))
    shown, shown_bars = _split_output(resume_out)
    printed, bars = _quickstart(tmp_path, resume_command)
    assert [_mask(line) for line in printed] == [_mask(line) for line in shown]
    assert [_mask(line) for line in bars] == [_mask(line) for line in shown_bars]

    ls_args = shlex.split(ls_command)
    assert ls_args[1:3] == ["ckpt", "ls"]
    listing = _run([sys.executable, "-m", "accelkit.cli.main", *ls_args[1:]], tmp_path).stdout
    header, rows = _ls_rows(listing)
    shown_header, shown_rows = _ls_rows("\n".join(ls_out))
    assert header == shown_header
    same = ("NAME", "STATE", "ITER", "STEP")
    assert [{k: r[k] for k in same} for r in rows] == [{k: r[k] for k in same} for r in shown_rows]
    for row in rows:  # and every column says what the manifest says
        folder = tmp_path / ls_args[3] / "checkpoints" / row["NAME"]
        manifest = json.loads((folder / "accelkit.json").read_text())
        assert int(row["STEP"]) == manifest["step"]
        assert int(row["ITER"]) == manifest["iteration"]
        assert int(row["FILES"]) == len(manifest["files"]) + 1  # + the manifest itself
        name, value = row["METRICS"].split("=")
        assert float(value) == pytest.approx(manifest["metrics"][name], rel=1e-5)
        assert re.fullmatch(r"\d+s", row["AGE"]) and re.fullmatch(r"[\d.]+ [KMG]?i?B", row["SIZE"])
