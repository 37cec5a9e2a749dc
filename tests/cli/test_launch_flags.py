"""`accelkit launch` takes `accelerate launch`'s flags and config files.

The list of flags is read from the installed accelerate's own argument parser, so a new accelerate
release with a new flag makes ``test_every_accelerate_flag_is_accepted_or_refused`` fail until the
flag is accepted or refused. Config files are written by the installed ``accelerate config``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from accelkit.cli.main import build_parser
from accelkit.launch.launcher import LaunchConfig, config_from_args, launch_env, torchrun_args

accelerate_launch = pytest.importorskip(
    "accelerate.commands.launch", reason="accelerate (a test dependency) provides the flag list"
)
ACCELERATE = [sys.executable, "-m", "accelerate.commands.accelerate_cli"]

# A valid value for each accepted flag that takes one (refused flags get any value).
SAMPLES = {
    "num_processes": "2",
    "num_machines": "1",
    "machine_rank": "0",
    "main_process_ip": "127.0.0.1",
    "main_process_port": "0",
    "gpu_ids": "all",
    "num_cpu_threads_per_process": "2",
    "mixed_precision": "bf16",
    "tee": "0",
    "role": "trainer",
    "rdzv_backend": "static",
    "rdzv_conf": "timeout=60",
    "max_restarts": "0",
    "monitor_interval": "0.5",
    "fsdp_version": "2",
    "fsdp_min_num_params": "1000",
    "fsdp_sharding_strategy": "FULL_SHARD",
    "fsdp_reshard_after_forward": "true",
    "fsdp_auto_wrap_policy": "NO_WRAP",
    "fsdp_transformer_layer_cls_to_wrap": "Block",
    "fsdp_offload_params": "false",
    "fsdp_state_dict_type": "SHARDED_STATE_DICT",
}


@pytest.fixture(autouse=True)
def _hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    return home


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('trained')\n")
    return str(path)


def _launch(*argv: str) -> tuple[LaunchConfig | None, str]:
    """Parse and validate an `accelkit launch` command line as the CLI does, without running it.

    Returns the config, or None and the error printed with the launch usage.
    """
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            parser = build_parser()
            args, unknown = parser.parse_known_args(["launch", *argv])
            if unknown:
                from accelkit.launch.flags import explain_unknown

                args._parser.error(explain_unknown(unknown, args._parser._option_string_actions))
            try:
                return config_from_args(args), ""
            except ValueError as exc:
                args._parser.error(str(exc))
        except SystemExit as exc:
            assert exc.code == 2
    return None, stderr.getvalue()


def _accelerate_options() -> list[tuple[str, argparse.Action]]:
    parser = accelerate_launch.launch_command_parser()
    return [
        (option, action)
        for action in parser._actions
        for option in action.option_strings
        if option not in ("-h", "--help")
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("option", "action"),
    _accelerate_options(),
    # the option alone: an action's repr names function addresses, which differ between
    # processes (pytest-xdist's workers must collect the same ids)
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_every_accelerate_flag_is_accepted_or_refused(
    option: str, action: argparse.Action, script: str, tmp_path: Path
) -> None:
    argv = [option]
    if action.nargs != 0:
        if action.dest == "config_file":
            value = str(tmp_path / "c.yaml")
            Path(value).write_text("distributed_type: 'NO'\n")
        elif action.dest == "log_dir":
            value = str(tmp_path / "logs")
        else:
            value = SAMPLES.get(action.dest, str(action.choices[0]) if action.choices else "1")
        argv.append(value)
    config, error = _launch("--cpu", *argv, script)
    if config is None:
        # Refused: with the launch usage, naming the flag as given and the reason.
        assert error.startswith("usage: accelkit launch "), error
        message = error.splitlines()[-1]
        assert message.startswith("accelkit launch: error: "), error
        assert option in message and "unrecognized" not in message, error
        assert len(message) > len(f"accelkit launch: error: {option}: ") + 20, error


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP"], None),
        (["--use_deepspeed"], "DeepSpeed is not supported"),
        (["--zero-stage", "2"], "DeepSpeed is not supported"),
        (["--tpu"], "TPU/XLA"),
        (["--use_megatron_lm"], "Megatron-LM"),
        (["--megatron-lm-some-future-flag", "1"], "Megatron-LM"),
        (["--fp8_backend", "te"], "FP8"),
        (["--mixed_precision", "fp8"], "FP8"),
        (["--dynamo_backend", "inductor"], "torch.compile(model)"),
        (["--dynamo_backend", "no"], None),
        (["--use_fsdp", "--fsdp_version", "1"], "FSDP2"),
        (["--use_fsdp", "--fsdp_state_dict_type", "FULL_STATE_DICT"], "save_model"),
        (["--use_fsdp", "--fsdp_activation_checkpointing", "true"], "torch.utils.checkpoint"),
        (["--use_fsdp", "--fsdp_activation_checkpointing", "false"], None),
        (["--enable_cpu_affinity"], "numactl"),
    ],
)
def test_refusals_name_the_reason(script: str, argv: list[str], expected: str | None) -> None:
    config, error = _launch("--cpu", *argv, script)
    if expected is None:
        assert config is not None, error
    else:
        assert config is None and expected in error, error
        assert [a for a in argv if a.startswith("--")][-1] in error  # the refused flag


def test_dashed_and_underscored_spellings_mean_the_same(script: str) -> None:
    dashed, _ = _launch(
        "--cpu", "--num-processes", "4", "--num-cpu-threads-per-process", "3", "--max-restarts",
        "2", "--use-fsdp", "--fsdp-auto-wrap-policy", "TRANSFORMER_BASED_WRAP",
        "--fsdp-transformer-layer-cls-to-wrap", "Block,Layer", "--fsdp-sharding-strategy",
        "SHARD_GRAD_OP", script, "--lr", "1",
    )  # fmt: skip
    underscored, _ = _launch(
        "--cpu", "--num_processes", "4", "--num_cpu_threads_per_process", "3", "--max_restarts",
        "2", "--use_fsdp", "--fsdp_auto_wrap_policy", "transformer_based_wrap",
        "--fsdp_transformer_layer_cls_to_wrap", "Block,Layer", "--fsdp_reshard_after_forward",
        "false", script, "--lr", "1",
    )  # fmt: skip
    assert dashed is not None and underscored is not None
    assert dashed.extra_env == underscored.extra_env
    env = dict(dashed.extra_env)
    assert env["OMP_NUM_THREADS"] == "3"
    assert env["ACCELKIT_FSDP_AUTO_WRAP_POLICY"] == "transformer_based_wrap"
    assert env["ACCELKIT_FSDP_TRANSFORMER_CLS_NAMES_TO_WRAP"] == "Block,Layer"
    assert env["ACCELKIT_FSDP_RESHARD_AFTER_FORWARD"] == "false"
    assert dashed.num_processes == 4 and dashed.max_restarts == 2
    assert dashed.script_args == ("--lr", "1")


def test_torchrun_options_are_passed_through(script: str, tmp_path: Path) -> None:
    config, error = _launch(
        "--cpu", "--num_processes", "2", "--tee", "3", "--log_dir", str(tmp_path), "--role",
        "trainer", "--monitor_interval", "0.5", "--rdzv_backend", "c10d", "--debug", "--quiet",
        script,
    )  # fmt: skip
    assert config is not None, error
    args = torchrun_args(config)
    for expected in ("--tee=3", f"--log-dir={tmp_path}", "--role=trainer", "--rdzv-backend=c10d"):
        assert expected in args
    assert f"--rdzv-endpoint=127.0.0.1:{config.main_process_port}" in args
    env = launch_env(config)
    assert env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL" and env["LOGLEVEL"] == "ERROR"


def test_gpu_ids_restrict_the_devices(script: str) -> None:
    config, error = _launch("--gpu_ids", "0,1", "--multi_gpu", script)
    assert config is not None, error
    assert dict(config.extra_env)["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert config.num_processes == 2  # one per listed GPU
    config, error = _launch("--gpu_ids", "0,x", script)
    assert config is None and "--gpu_ids ('0,x')" in error and "comma-separated" in error


def _accelerate_config_default(hf_home: Path, *args: str) -> Path:
    subprocess.run(
        [*ACCELERATE, "config", "default", *args],
        env={**os.environ, "HF_HOME": str(hf_home)},
        check=True,
        capture_output=True,
        timeout=120,
    )
    return hf_home / "accelerate" / "default_config.yaml"


@pytest.mark.slow
def test_reads_the_default_file_of_accelerate_config(_hf_home: Path, script: str) -> None:
    path = _accelerate_config_default(_hf_home, "--mixed_precision", "bf16")
    assert path.is_file()
    config, error = _launch(script)
    assert config is not None, error
    assert config.mixed_precision == "bf16" and config.cpu  # this machine has no GPU to use
    # The command line wins over the file.
    config, error = _launch("--mixed_precision", "fp16", script)
    assert config is not None and config.mixed_precision == "fp16", error
    # As with accelerate launch, --cpu skips the default file (an explicit one is still read).
    config, _ = _launch("--cpu", script)
    assert config is not None and config.mixed_precision == "no"
    config, _ = _launch("--cpu", "--config_file", str(path), script)
    assert config is not None and config.mixed_precision == "bf16"


@pytest.mark.slow
def test_reads_an_accelerate_file_given_with_config_file(tmp_path: Path, script: str) -> None:
    path = tmp_path / "elsewhere" / "launch.yaml"
    _accelerate_config_default(tmp_path / "unused", "--config_file", str(path))
    path.write_text(path.read_text().replace('"num_processes": 1', '"num_processes": 2'))
    config, error = _launch("--config-file", str(path), script)
    assert config is not None, error
    assert config.num_processes == 2 and config.cpu
    config, error = _launch("--config-file", str(path), "--num_processes", "3", script)
    assert config is not None and config.num_processes == 3, error


def test_reads_an_fsdp_file(tmp_path: Path, script: str) -> None:
    path = tmp_path / "fsdp.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            compute_environment: LOCAL_MACHINE
            distributed_type: FSDP
            fsdp_config:
              fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
              fsdp_cpu_ram_efficient_loading: true
              fsdp_offload_params: false
              fsdp_reshard_after_forward: false
              fsdp_state_dict_type: SHARDED_STATE_DICT
              fsdp_transformer_layer_cls_to_wrap: Block
              fsdp_version: 2
            mixed_precision: bf16
            num_processes: 2
            use_cpu: true
            tpu_use_cluster: false
            main_training_function: main
            """
        )
    )
    config, error = _launch("--config_file", str(path), script)
    assert config is not None, error
    env = dict(config.extra_env)
    assert env["ACCELKIT_USE_FSDP"] == "1"
    assert env["ACCELKIT_FSDP_AUTO_WRAP_POLICY"] == "transformer_based_wrap"
    assert env["ACCELKIT_FSDP_RESHARD_AFTER_FORWARD"] == "false"
    assert config.num_processes == 2 and config.mixed_precision == "bf16"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("distributed_type: DEEPSPEED\n", "distributed_type ('DEEPSPEED'): DeepSpeed"),
        ("distributed_type: XLA\n", "TPU/XLA"),
        ("compute_environment: AMAZON_SAGEMAKER\n", "SageMaker"),
        ("distributed_type: 'NO'\nfp8_config:\n  backend: TE\n", "fp8_config.backend"),
        ("distributed_type: 'NO'\ntpu_use_cluster: true\n", "tpu_use_cluster"),
        ("distributed_type: 'NO'\nnum_processes: many\n", "num_processes: expected an integer"),
        ("distributed_type: 'NO'\nbogus_key: 1\n", "bogus_key is not a setting"),
        ("- a list\n", "must hold a mapping"),
    ],
)
def test_bad_config_files_are_refused(
    tmp_path: Path, script: str, content: str, expected: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    config, error = _launch("--config_file", str(path), script)
    assert config is None and expected in error, error
    assert str(path) in error


def test_missing_config_file_names_the_fix(tmp_path: Path, script: str) -> None:
    config, error = _launch("--config_file", str(tmp_path / "nope.yaml"), script)
    assert config is None and "nope.yaml' does not exist" in error and "accelkit config" in error


def _accelkit(*args: str, stdin: str = "", **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "accelkit.cli.main", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=180,
    )


@pytest.mark.slow
def test_config_default_writes_a_file_both_tools_read(_hf_home: Path, script: str) -> None:
    proc = _accelkit("config", "default", "--mixed_precision", "fp16")
    assert proc.returncode == 0, proc.stderr
    path = _hf_home / "accelerate" / "default_config.yaml"
    assert str(path) in proc.stdout
    written = yaml.safe_load(path.read_text())
    assert (
        written["mixed_precision"] == "fp16" and written["compute_environment"] == "LOCAL_MACHINE"
    )
    config, error = _launch(script)
    assert config is not None and config.mixed_precision == "fp16", error
    # accelerate's own loader reads it too.
    from accelerate.commands.config.config_args import load_config_from_file

    assert load_config_from_file(str(path)).mixed_precision == "fp16"
    # An existing file is not overwritten.
    again = _accelkit("config", "default", "--mixed_precision", "bf16")
    assert again.returncode == 1 and "not overwriting" in again.stderr
    assert yaml.safe_load(path.read_text())["mixed_precision"] == "fp16"


@pytest.mark.slow
def test_config_questions_write_what_launch_reads(tmp_path: Path, script: str) -> None:
    path = tmp_path / "asked.yaml"
    answers = "fsdp\n1\n2\nall\nbf16\nTRANSFORMER_BASED_WRAP\nBlock\nno\nno\n"
    proc = _accelkit("config", "--config_file", str(path), stdin=answers)
    assert proc.returncode == 0, proc.stderr
    config, error = _launch("--config_file", str(path), "--cpu", script)
    assert config is not None, error
    env = dict(config.extra_env)
    assert config.num_processes == 2 and config.mixed_precision == "bf16"
    assert env["ACCELKIT_FSDP_TRANSFORMER_CLS_NAMES_TO_WRAP"] == "Block"
    assert env["ACCELKIT_FSDP_RESHARD_AFTER_FORWARD"] == "false"


@pytest.mark.slow
def test_version() -> None:
    from accelkit import __version__

    for argv in (["--version"], ["launch", "--version"]):
        proc = _accelkit(*argv)
        assert proc.returncode == 0 and proc.stdout.strip() == f"accelkit {__version__}"


@pytest.mark.slow
def test_real_two_process_launch_from_a_config_file(tmp_path: Path) -> None:
    script = tmp_path / "world.py"
    script.write_text(
        "import json, os, sys\n"
        "json.dump({k: os.environ.get(k) for k in ('WORLD_SIZE', 'ACCELKIT_MIXED_PRECISION', "
        "'OMP_NUM_THREADS')}, open(sys.argv[1] + os.environ['RANK'], 'w'))\n"
    )
    path = tmp_path / "two.yaml"
    path.write_text(
        "distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 2\nmixed_precision: bf16\n"
    )
    out = str(tmp_path / "rank")
    proc = _accelkit(
        "launch", "--config-file", str(path), "--num-cpu-threads-per-process", "1", str(script), out
    )
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        seen = json.loads(Path(f"{out}{rank}").read_text())
        assert seen == {
            "WORLD_SIZE": "2",
            "ACCELKIT_MIXED_PRECISION": "bf16",
            "OMP_NUM_THREADS": "1",
        }
