"""Write the results table of ``benchmarks/README.md`` from ``benchmarks/results/*.json``.

``python -m benchmarks.report`` replaces everything between the two markers
``<!-- results:begin -->`` and ``<!-- results:end -->`` in the README with tables generated from
the JSON files, so no figure in the README is ever typed by hand. ``--print`` writes the tables to
stdout instead.

A result file of any benchmark is understood if it has the keys of
:func:`benchmarks.common.write_result` (``targets``, ``notes``, ``machine``, ``versions``,
``date``); the benchmarks of this folder also get a detail table each. Where a target was missed,
the reason is what the benchmark measured, followed by the diagnosis from
``results/reasons.json`` (target name -> text) where one was recorded by hand.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import QUICK_RESULTS_DIR, RESULTS_DIR

README = Path(__file__).resolve().parent / "README.md"
BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"
ORDER = ["save_load", "async", "trackers", "s3", "step", "scaling"]


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, (int, float)):
        v = float(value)
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.{digits}g}"
    return str(value)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def load_results(folder: Path = RESULTS_DIR) -> dict[str, dict[str, Any]]:
    """Every ``*.json`` result file in ``folder`` (``reasons.json`` excluded), by name."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.json")):
        if path.name == "reasons.json":
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"skipping {path.name}: {exc}", file=sys.stderr)
            continue
        if isinstance(data, dict):
            data.setdefault(
                "_mtime",
                _dt.datetime.fromtimestamp(path.stat().st_mtime, _dt.timezone.utc).strftime(
                    "%Y-%m-%d %H:%M UTC (file time)"
                ),
            )
            found[path.stem] = data
    rank = {name: i for i, name in enumerate(ORDER)}
    return dict(sorted(found.items(), key=lambda kv: (rank.get(kv[0], len(ORDER)), kv[0])))


def _reasons(folder: Path = RESULTS_DIR) -> dict[str, str]:
    path = folder / "reasons.json"
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _fmt_target(value: Any, unit: str) -> str:
    if value is None:
        return "n/a"
    text = _num(value)
    if unit in ("x",):
        return f"{text}x"
    if unit == "%":
        return f"{text}%"
    return f"{text} {unit}".strip()


def _tracker_targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Targets of issue 4 from ``bench_trackers.py``'s own JSON schema (it has no targets)."""
    out = []
    for backend, result in (data.get("results") or {}).items():
        if not isinstance(result, dict):
            continue
        if backend == "non_main":
            value = result.get("median_us")
            out.append(
                {"name": "log() on a non-main process", "value": value, "threshold": 2.0,
                 "unit": "us", "higher_is_better": False,
                 "passed": value is not None and value <= 2.0}
            )  # fmt: skip
            continue
        if "error" in result:
            out.append(
                {"name": f"log() blocking vs accelerate, {backend}", "value": None,
                 "threshold": 10.0, "unit": "x", "passed": False,
                 "reason": "benchmark failed: " + result["error"].strip().splitlines()[-1]}
            )  # fmt: skip
            continue
        for pattern, sides in result.items():
            if not isinstance(sides, dict) or "accelerate" not in sides:
                continue
            kit = sides["accelkit"]["median_us"]
            ref = sides["accelerate"]["median_us"]
            value = ref / kit if kit else None
            out.append(
                {"name": f"log() blocking vs accelerate, {backend}, {pattern}", "value": value,
                 "threshold": 10.0, "unit": "x",
                 "passed": value is not None and value >= 10.0}
            )  # fmt: skip
    return out


def _targets_of(name: str, data: dict[str, Any]) -> list[dict[str, Any]]:
    if "targets" in data:
        return list(data.get("targets") or [])
    if name == "trackers":
        return _tracker_targets(data)
    return []


def _is_quick(data: dict[str, Any]) -> bool:
    return bool(data.get("quick", (data.get("settings") or {}).get("quick", False)))


def targets_table(results: dict[str, dict[str, Any]], reasons: dict[str, str]) -> list[str]:
    """One row per target of every benchmark: measured, goal, pass/fail, reason if missed."""
    rows = []
    for name, data in results.items():
        for t in _targets_of(name, data):
            unit = t.get("unit", "")
            sign = ">=" if t.get("higher_is_better", True) else "<="
            passed = bool(t.get("passed"))
            reason = ""
            if not passed:
                measured = t.get("reason") or ""
                diagnosis = reasons.get(t.get("name", ""), "")
                reason = " ".join(
                    part
                    for part in (
                        f"Measured: {measured}." if measured else "",
                        f"Diagnosis: {diagnosis}" if diagnosis else "",
                    )
                    if part
                )
            rows.append(
                [
                    data.get("title") or name,
                    t.get("name", ""),
                    _fmt_target(t.get("value"), unit),
                    f"{sign} {_fmt_target(t.get('threshold'), unit)}",
                    "pass" if passed else "**MISS**",
                    reason + (" (quick run)" if _is_quick(data) else ""),
                ]
            )
    if not rows:
        return ["No targets measured yet."]
    return _table(["benchmark", "target", "measured", "goal", "result", "reason if missed"], rows)


def _save_load_details(data: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for label, r in (data.get("results", {}).get("sizes") or {}).items():
        out += ["", f"Save, {label} of state ({r.get('tensors')} tensors):", ""]
        out += _table(
            ["case", "seconds", "GB/s", "x accelerate", "% of raw write", "peak extra MB"],
            [
                [
                    name,
                    _num(row.get("seconds")),
                    _num(row.get("gb_per_s")),
                    _num(row.get("ratio_to_accelerate")),
                    _num(100 * (row.get("fraction_of_raw") or 0)),
                    _num((row.get("peak_extra_memory_bytes") or 0) / 1e6),
                ]
                for name, row in r.get("save", {}).items()
            ],
        )
        for cache, table in (r.get("load") or {}).items():
            out += ["", f"Load, {label}, {cache} page cache:", ""]
            out += _table(
                ["case", "seconds", "GB/s", "x accelerate", "peak extra MB"],
                [
                    [
                        name,
                        _num(row.get("seconds")),
                        _num(row.get("gb_per_s")),
                        _num(row.get("ratio_to_accelerate")),
                        _num((row.get("peak_extra_memory_bytes") or 0) / 1e6),
                    ]
                    for name, row in table.items()
                ],
            )
    return out


def _s3_details(data: dict[str, Any]) -> list[str]:
    r = data.get("results") or {}
    if not r:
        return []
    out = ["", f"{_num((r.get('state_bytes') or 0) / 1e6)} MB of state:", ""]
    rows = [
        [
            f"{kind}: {name}",
            _num(row.get("seconds")),
            _num(row.get("gb_per_s")),
            _num(100 * (row.get("fraction_of_s3fs") or 0)),
        ]
        for kind in ("save", "load")
        for name, row in (r.get(kind) or {}).items()
    ]
    out += _table(["case", "seconds", "GB/s", "% of raw s3fs"], rows)
    settings = r.get("settings") or {}
    if settings:
        out += ["", "Settings: " + "; ".join(f"{k}: {json.dumps(v)}" for k, v in settings.items())]
    return out


def _scaling_details(data: dict[str, Any]) -> list[str]:
    r = data.get("results") or {}
    out: list[str] = []
    for key, xs_key, what in (
        ("tensors", "parameters", "parameters"),
        ("checkpoints", "checkpoints", "checkpoints in the folder"),
    ):
        block = r.get(key)
        if not block:
            continue
        xs = block.get(xs_key) or []
        out += ["", f"Seconds (median) against the number of {what}:", ""]
        out += _table(
            ["operation", *map(str, xs), "log-log slope"],
            [
                [name, *map(_num, vals), _num(block.get("slope", {}).get(name))]
                for name, vals in (block.get("seconds") or {}).items()
            ],
        )
        if block.get("plot"):
            out += ["", f"![{key}](results/{block['plot']})"]
    return out


def _async_details(data: dict[str, Any]) -> list[str]:
    r = data.get("results") or {}
    if r.get("skipped"):
        return ["", f"Skipped: {r['skipped']}."]
    out: list[str] = []
    if r.get("save"):
        out += [""]
        out += _table(
            ["case", "seconds", "/ accelerate save", "% of raw write"],
            [
                [
                    n,
                    _num(row.get("seconds")),
                    _num(row.get("fraction_of_accelerate")),
                    _num(100 * (row.get("fraction_of_raw") or 0)),
                ]
                for n, row in r["save"].items()
            ],
        )
    loop = r.get("loop")
    if loop:
        out += [
            "",
            f"Training loop, a save every {loop['save_every']} of {loop['steps']} steps:",
            "",
        ]
        steady = loop.get("throughput_lost_steady") or {}
        out += _table(
            ["loop", "steps/s", "% throughput lost", "% lost, steady state"],
            [
                [
                    k,
                    _num(v),
                    _num(100 * loop["throughput_lost"][k]),
                    _num(100 * steady[k]) if k in steady else "n/a",
                ]
                for k, v in loop["steps_per_s"].items()
            ],
        )
        out += [
            "",
            "- % throughput lost: the whole loop, its final wait for the last save included; "
            "steady state: from the first save's return to the last's (whole intervals, each "
            "with one save and the previous one's background write), as in a long run.",
        ]
    return out


def _trackers_details(data: dict[str, Any]) -> list[str]:
    rows = []
    for backend, result in (data.get("results") or {}).items():
        if not isinstance(result, dict):
            continue
        if backend == "non_main":
            rows.append(["non-main process", "", _num(result.get("median_us")), "", ""])
            continue
        if "error" in result:
            last = result["error"].strip().splitlines()[-1] if result["error"].strip() else ""
            rows.append([backend, "", "failed", "", last])
            continue
        for pattern, sides in result.items():
            if not isinstance(sides, dict) or "accelkit" not in sides:
                continue
            kit = sides["accelkit"].get("median_us")
            ref = (sides.get("accelerate") or {}).get("median_us")
            ratio = ref / kit if ref and kit else None
            rows.append([backend, pattern, _num(kit), _num(ref), _num(ratio)])
    if not rows:
        return []
    out = ["", "Median time `log()` blocks the caller, microseconds per call:", ""]
    out += _table(["backend", "pattern", "accelkit", "accelerate", "accelerate / accelkit"], rows)
    return out


def _step_details(data: dict[str, Any]) -> list[str]:
    r = data.get("results") or {}
    rows = [
        [name, _num(v.get("median_step_us")), _num(v.get("ratio_vs_plain")),
         _num(v.get("overhead_pct"))]
        for name, v in r.items()
        if isinstance(v, dict) and "median_step_us" in v
    ]  # fmt: skip
    if not rows:
        return []
    model = r.get("model", "")
    head = f"{model}, batch {r.get('batch_size')}, {r.get('threads')} thread:"
    return ["", head, "", *_table(["case", "median step (us)", "ratio", "overhead %"], rows)]


def _cuda_details(data: dict[str, Any]) -> list[str]:
    r = data.get("results") or {}
    if not r.get("cases"):
        return []
    floor = r["cases"]["d2h pinned"]["seconds"]
    out = ["", f"{_num(r['state_bytes'] / 1e6)} MB of model + AdamW state on {r['device']}:", ""]
    rows = [
        [name, _num(row["seconds"]), _num(row["gb_per_s"]), _num(row["seconds"] / floor)]
        for name, row in r["cases"].items()
    ]
    out += _table(["case", "seconds", "GB/s", "x pinned copy"], rows)
    if "throughput_lost_percent" in r:
        out += [
            "",
            f"Training throughput lost with an async save every "
            f"{r.get('save_every_steps', 350)} steps: "
            f"{_num(r['throughput_lost_percent'])}% "
            f"({_num(r['throughput_lost_beyond_blocking_percent'])}% beyond the copies)"
            + (
                f"; with the process writer: {_num(r['throughput_lost_percent_process_writer'])}%."
                if "throughput_lost_percent_process_writer" in r
                else "."
            ),
        ]
    return out


def _soak_journal_details(data: dict[str, Any]) -> list[str]:
    """The tracker journal's outage soak (tests/reliability/soak_journal.py): one row a run."""
    lines = [
        "",
        f"{data.get('points')} points, {data.get('processes')} processes, {data.get('cpus')} "
        f"cores, server killed {data.get('kill_at_s')} s in and down {data.get('down_s')} s, "
        f"{data.get('matmuls_per_step')} matmuls a step, git {data.get('commit')}:",
        "",
    ]
    rows = []
    for name, run in (data.get("runs") or {}).items():
        rows.append(
            [
                name,
                _num(run.get("steps_per_s")),
                _num(run.get("log_seconds")),
                _num((run.get("load_average_before") or [None])[0]),
                run.get("restarted_before_the_loop_ended", "n/a"),
                _num(run.get("delivered_during_the_run")),
                _num(run.get("mlflow_points")),
                run.get("mlflow_exactly_once", "n/a"),
                _num(run.get("jsonl_points")),
                _num(run.get("tensorboard_points")),
            ]
        )
    header = [
        "run",
        "steps/s",
        "s in log() (rank 0)",
        "load before",
        "server back in the run",
        "MLflow points in the run",
        "MLflow points",
        "exactly once",
        "jsonl",
        "TensorBoard",
    ]
    lines += _table(header, rows)
    lines += [
        "",
        f"- throughput vs the mean of the baselines: outage "
        f"{_num(data.get('outage_throughput_change_pct'))}%, never back "
        f"{_num(data.get('never_back_throughput_change_pct'))}% (the baselines differ by "
        f"{_num(data.get('baselines_differ_pct'))}%). "
        + (
            f"The job ran on CPU {data['job_cpus']}, the server and the driver on the others."
            if data.get("job_cpus")
            else "The MLflow server shared the cores with the job, so a run without it is faster."
        ),
    ]
    return lines


DETAILS = {
    "cuda": _cuda_details,
    "trackers": _trackers_details,
    "step": _step_details,
    "save_load": _save_load_details,
    "s3": _s3_details,
    "scaling": _scaling_details,
    "async": _async_details,
    "soak_journal": _soak_journal_details,
}


def _machine_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """Machine and package versions once per distinct set; each run with date, git, load."""
    groups: dict[str, list[str]] = {}
    for name, data in results.items():
        m = data.get("machine") or {}
        v = dict(data.get("versions") or {})
        git = v.pop("git", None)
        if "cpu" in m:
            machine = (
                f"{m.get('cpu')}, {m.get('cores')} cores, {m.get('memory_gb')} GB RAM, "
                f"disk {m.get('disk')}, GPU {m.get('gpu') or 'none'}; {m.get('os')}"
            )
        else:
            machine = ", ".join(f"{k} {val}" for k, val in m.items())
        vers = ", ".join(f"{k} {val}" for k, val in v.items() if val)
        load = m.get("load_average")
        details = [str(data.get("date") or data.get("_mtime"))]
        if _is_quick(data):
            details.append("quick")
        if git:
            details.append(f"git {git}")
        if load:
            details.append(f"load average {load[0]} at the end")
        groups.setdefault(f"- Machine: {machine}\n- Versions: {vers}", []).append(
            f"{name} ({', '.join(details)})"
        )
    out = []
    for text, runs in groups.items():
        out += [text, f"- Runs: {'; '.join(runs)}", ""]
    return out


def render(results: dict[str, dict[str, Any]] | None = None) -> str:
    """The markdown that goes between the README markers (full-mode results by default)."""
    results = load_results() if results is None else results
    reasons = _reasons()
    lines = ["### Targets", ""]
    lines += targets_table(results, reasons)
    lines += ["", "### Machine, versions, date", ""]
    lines += _machine_lines(results)
    for name, data in results.items():
        lines += [f"### {data.get('title') or data.get('benchmark') or name}"]
        detail = DETAILS.get(name)
        if detail is not None:
            lines += detail(data)
        notes = data.get("notes") or []
        if notes:
            lines += [""] + [f"- {n}" for n in notes]
        lines += [""]
    return "\n".join(lines).rstrip() + "\n"


def update_readme(readme: Path = README) -> bool:
    """Replace the generated part of ``readme``; return whether the file changed."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(
            f"{readme} has no {BEGIN} ... {END} markers; add them where the table should go."
        )
    head, rest = text.split(BEGIN, 1)
    _old, tail = rest.split(END, 1)
    new = (
        f"{head}{BEGIN}\n<!-- generated by `python -m benchmarks.report`; do not edit -->\n\n"
        f"{render()}\n{END}{tail}"
    )
    if new != text:
        readme.write_text(new)
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    """Command line: update the README (default) or ``--print`` the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print", action="store_true", help="print instead of editing README")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="print the targets of the --quick results (results/quick/); never edits README",
    )
    args = parser.parse_args(argv)
    if args.quick:
        print("\n".join(targets_table(load_results(QUICK_RESULTS_DIR), _reasons())))
        return 0
    if args.print:
        print(render())
        return 0
    changed = update_readme()
    print(f"{README} {'updated' if changed else 'unchanged'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
