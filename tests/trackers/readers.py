"""Read what each backend wrote, with the backend's own reader.

Every reader returns ``(scalars, config)``: ``scalars`` maps a metric name to its list of
``(step, value)`` in logged order; ``config`` maps flat config keys to their stored values.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import subprocess
import sys
import zipfile
from typing import Any

Scalars = dict[str, list[tuple[int, float]]]


def read_tensorboard(logging_dir: str, run: str) -> tuple[Scalars, dict[str, Any]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(os.path.join(logging_dir, run))
    events.Reload()
    scalars = {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    config = {}
    for key, value in start.session_start_info.hparams.items():
        config[key] = getattr(value, value.WhichOneof("kind"))
    return scalars, config


def read_jsonl(logging_dir: str, run: str) -> tuple[Scalars, dict[str, Any]]:
    from accelkit.trackers.backends.jsonl import read_jsonl as read

    scalars: Scalars = {}
    for record in read(os.path.join(logging_dir, run)):
        for key, value in record["values"].items():
            if isinstance(value, (int, float)):
                scalars.setdefault(key, []).append((record["step"], value))
    with open(os.path.join(logging_dir, run, "config.json")) as file:
        return scalars, _flat(json.load(file))


def read_csv_custom(logging_dir: str, run: str) -> tuple[Scalars, dict[str, Any]]:
    scalars: Scalars = {}
    with open(os.path.join(logging_dir, run, "custom.csv")) as file:
        for line in file:
            step, key, value = line.strip().split(",")
            scalars.setdefault(key, []).append((int(step), float(value)))
    with open(os.path.join(logging_dir, run, "custom_config.json")) as file:
        return scalars, json.load(file)


def read_mlflow(tracking_uri: str, experiment: str) -> tuple[Scalars, dict[str, Any]]:
    """The single run of ``experiment`` in the store at ``tracking_uri``."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r} at {tracking_uri}"
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1, f"expected one run, found {len(runs)}"
    run = runs[0]
    assert run.info.status == "FINISHED", run.info.status
    scalars = {
        key: [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key),
                                                key=lambda m: (m.step, m.timestamp))]
        for key in run.data.metrics
    }  # fmt: skip
    return scalars, dict(run.data.params)


def wandb_run_file(logging_dir: str) -> str:
    files = glob.glob(os.path.join(logging_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(files) == 1, f"expected one offline wandb run under {logging_dir}, found {files}"
    return files[0]


def read_wandb(logging_dir: str, run: str) -> tuple[Scalars, dict[str, Any]]:
    """Decode the offline run's transaction log with wandb's own reader (``wandb leet``)."""
    wandb_cli = os.path.join(os.path.dirname(sys.executable), "wandb")
    out = subprocess.run(
        [wandb_cli, "leet", "inspect", "--json", wandb_run_file(logging_dir)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    scalars: Scalars = {}
    config: dict[str, Any] = {}
    for line in out.stdout.splitlines():
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        kind = record.get("type")
        if kind == "history":
            item = record["history"]["item"]
            for key, value in item.items():
                if not key.startswith("_") and isinstance(value, (int, float)):
                    scalars.setdefault(key, []).append((item["_step"], value))
        elif kind == "run":
            config.update(record["run"].get("config", {}).get("update", {}))
        elif kind == "config":
            config.update(record["config"].get("update", {}))
    config.pop("_wandb", None)
    return scalars, _flat(config)


def comet_archive(logging_dir: str) -> str:
    archives = glob.glob(os.path.join(logging_dir, "comet_ml", "*.zip"))
    assert len(archives) == 1, f"expected one Comet offline archive, found {archives}"
    return archives[0]


def read_comet(logging_dir: str, run: str) -> tuple[Scalars, dict[str, Any]]:
    """Read ``messages.json`` of the offline archive (what ``comet upload`` sends)."""
    scalars: Scalars = {}
    config: dict[str, Any] = {}
    with zipfile.ZipFile(comet_archive(logging_dir)) as archive:
        lines = archive.read("messages.json").decode().splitlines()
        experiment = json.loads(archive.read("experiment.json"))
    assert experiment.get("project_name") == run, experiment
    for line in lines:
        message = json.loads(line)
        payload = message["payload"]
        if message["type"] == "metric_msg":
            metric = payload["metric"]
            name = metric["metricName"]
            if name != "process duration":
                scalars.setdefault(name, []).append((metric["step"], metric["metricValue"]))
        elif message["type"] == "parameter_msg":
            param = payload.get("param") or payload.get("params")
            if param.get("source") == "manual":
                config[param["paramName"]] = param["paramValue"]
    return scalars, config


def trackio_logs(logging_dir: str, project: str) -> dict[str, list[dict[str, Any]]]:
    """Every run of trackio ``project`` under ``logging_dir``: its name -> its logged rows (each
    with ``step``), read from trackio's local database with trackio's ``SQLiteStorage``."""
    from accelkit.trackers.backends.trackio import use_trackio_folder

    use_trackio_folder(os.path.join(logging_dir, "trackio"))
    from trackio.sqlite_storage import SQLiteStorage

    return {name: SQLiteStorage.get_logs(project, name) for name in SQLiteStorage.get_runs(project)}


def read_trackio(logging_dir: str, run: str) -> tuple[Scalars, dict[str, Any]]:
    """The single run of trackio project ``run`` in ``<logging_dir>/trackio``."""
    from trackio.sqlite_storage import SQLiteStorage

    ((name, rows),) = trackio_logs(logging_dir, run).items()
    scalars: Scalars = {}
    for row in rows:
        for key, value in row.items():
            if key not in ("step", "timestamp") and isinstance(value, (int, float)):
                scalars.setdefault(key, []).append((row["step"], value))
    config = SQLiteStorage.get_run_config(run, name) or {}
    return scalars, _flat(config)


def swanlab_runs(logging_dir: str) -> list[dict[str, Any]]:
    """Every SwanLab run folder under ``<logging_dir>/swanlog``, oldest first, read with
    SwanLab's own ``DataStoreReader``: ``{"id", "project", "scalars": {key: [(step, value)]},
    "media": {key: [step]}, "config": {...}, "torn": <the file ends in a torn record>}``."""
    import yaml
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreError, DataStoreReader

    runs = []
    for folder in sorted(glob.glob(os.path.join(logging_dir, "swanlog", "run-*"))):
        (path,) = glob.glob(os.path.join(folder, "run-*.swanlab"))
        # SwanLab names the file after the run id, which its start record holds too.
        file_id = os.path.basename(path)[len("run-") : -len(".swanlab")]
        run: dict[str, Any] = {"id": file_id, "scalars": {}, "media": {}, "torn": False}
        reader = DataStoreReader()
        try:
            reader.open(path)
        except AssertionError:
            # SwanLab writes from a background thread: a killed job's file may end before
            # its header, even be empty.
            run["torn"] = True
        while not run["torn"]:
            try:
                data = reader.scan()
            except (DataStoreError, AssertionError):  # the torn end of a killed job's file
                run["torn"] = True
                break
            if data is None:
                break
            record = Record()
            record.ParseFromString(data)
            kind = record.WhichOneof(Record.DESCRIPTOR.oneofs[0].name)
            if kind == "start":
                assert record.start.id == file_id, (record.start.id, path)
                run["project"] = record.start.project
            elif kind == "scalar":
                scalar = record.scalar
                run["scalars"].setdefault(scalar.key, []).append((scalar.step, scalar.value.number))
            elif kind == "media":
                run["media"].setdefault(record.media.key, []).append(record.media.step)
        with open(os.path.join(folder, "files", "config.yaml"), encoding="utf-8") as file:
            stored = yaml.safe_load(file) or {}
        run["config"] = {key: entry["value"] for key, entry in stored.items()}
        runs.append(run)
    return runs


def read_swanlab(logging_dir: str, run: str) -> tuple[Scalars, dict[str, Any]]:
    """The single SwanLab run folder under ``<logging_dir>/swanlog`` (of project ``run``)."""
    (found,) = swanlab_runs(logging_dir)
    assert found["project"] == run, found["project"]
    return found["scalars"], _flat(found["config"])


def clearml_sessions(logging_dir: str) -> list[dict[str, Any]]:
    """Every ClearML offline session under ``<logging_dir>/clearml/offline``, as ClearML keeps
    it for ``Task.import_offline_session``: ``{"id", "project", "name", "parent", "scalars": {key:
    [(iteration, value)]}, "single": {name: value}, "images": {(title, series):
    [iteration]}, "tables": {key: [iteration]}, "config": {...}, "zipped": <the session's
    .zip is there>}``. A key is the title in series ``train`` and ``<series>_<title>`` in any
    other (Accelerate's keys back); the configuration is read with ClearML's own
    ``text_to_config_dict``."""
    from clearml.utilities.config import text_to_config_dict

    sessions = []
    pattern = os.path.join(logging_dir, "clearml", "offline", "*", "task.json")
    for task_file in sorted(glob.glob(pattern)):
        folder = os.path.dirname(task_file)
        with open(task_file, encoding="utf-8") as file:
            task = json.load(file)
        session: dict[str, Any] = {
            "id": task["id"], "project": task["project_name"], "name": task["name"],
            "parent": task.get("parent"),
            "scalars": {}, "single": {}, "images": {}, "tables": {},
            "zipped": os.path.isfile(folder + ".zip"),
        }  # fmt: skip
        metrics = os.path.join(folder, "metrics.jsonl")
        lines = []
        if os.path.exists(metrics):
            with open(metrics, encoding="utf-8") as file:
                lines = file.read().splitlines()
        for line in lines:
            for event in json.loads(line):
                title, series = event.get("metric"), event.get("variant")
                key = title if series == "train" else f"{series}_{title}"
                if str(title).startswith(":monitor:"):
                    continue  # ClearML's resource monitor (machine stats, after 30 s)
                if event["type"] == "training_stats_scalar" and title == "Summary":
                    session["single"][series] = event["value"]
                elif event["type"] == "training_stats_scalar":
                    session["scalars"].setdefault(key, []).append((event["iter"], event["value"]))
                elif event["type"] == "training_debug_image":
                    session["images"].setdefault((title, series), []).append(event["iter"])
                elif event["type"] == "plot":
                    session["tables"].setdefault(key, []).append(event["iter"])
        stored = task.get("configuration", {}).get("General", {}).get("value", "")
        session["config"] = dict(text_to_config_dict(stored)) if stored else {}
        sessions.append(session)
    return sessions


def read_clearml(logging_dir: str, run: str) -> tuple[Scalars, dict[str, Any]]:
    """The single ClearML offline session under ``<logging_dir>/clearml`` (of project ``run``)."""
    (found,) = clearml_sessions(logging_dir)
    assert found["project"] == run and found["zipped"], found
    return found["scalars"], _flat(found["config"])


def dvclive_metrics(folder: str) -> Scalars:
    """Every metric of a DVCLive folder, from its ``plots/metrics/<name>.tsv`` files (a header
    ``step<TAB><name>``, then one row per point), by the name it was logged under."""
    scalars: Scalars = {}
    root = os.path.join(folder, "plots", "metrics")
    for path in sorted(glob.glob(os.path.join(root, "**", "*.tsv"), recursive=True)):
        name = os.path.relpath(path, root)[: -len(".tsv")]
        with open(path, encoding="utf-8", newline="") as file:
            rows = list(csv.DictReader(file, delimiter="\t"))
        scalars[name] = [(int(row["step"]), float(row[os.path.basename(name)])) for row in rows]
    return scalars


def read_dvclive(logging_dir: str, run: str) -> tuple[Scalars, dict[str, Any]]:
    """The DVCLive folder ``<logging_dir>/<run>/dvclive``: its metrics, and its ``params.yaml``
    read with DVCLive's own YAML loader."""
    from dvclive.serialize import load_yaml

    folder = os.path.join(logging_dir, run, "dvclive")
    return dvclive_metrics(folder), _flat(load_yaml(os.path.join(folder, "params.yaml")))


def aim_runs(logging_dir: str) -> dict[str, Any]:
    """Every run of the Aim repository in ``logging_dir``, by hash, read-only with Aim's
    ``Repo`` after indexing each run (a job's runs are indexed by ``aim up`` otherwise)."""
    from aim import Repo
    from aim.sdk.index_manager import RepoIndexManager

    repo = Repo.from_path(logging_dir)
    for run_hash in repo.list_all_runs():
        RepoIndexManager.get_index_manager(repo).index(run_hash)
    repo = Repo(logging_dir)  # a fresh view of the index
    return {run.hash: run for run in repo.iter_runs()}


def aim_metrics(run: Any) -> Scalars:
    """A run's metrics with the empty context, by name: ``[(step, value), ...]``."""
    scalars: Scalars = {}
    for metric in run.metrics():
        if metric.context.to_dict() or metric.name.startswith("__system__"):
            continue
        steps, (values,) = metric.data.view("val").items_list()
        scalars[metric.name] = sorted(zip(steps, map(float, values)))
    return scalars


def read_aim(logging_dir: str, run: str) -> tuple[Scalars, dict[str, Any]]:
    """The one Aim run named ``run`` in ``<logging_dir>/.aim``: metrics and ``hparams``."""
    (found,) = [r for r in aim_runs(logging_dir).values() if r.name == run]
    return aim_metrics(found), _flat(found["hparams"])


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}/{key}" if prefix else key
        if isinstance(value, dict) and value:
            flat.update(_flat(value, name))
        else:
            flat[name] = value
    return flat
