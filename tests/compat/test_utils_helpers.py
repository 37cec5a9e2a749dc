"""Helpers of accelkit.utils that scripts written for Accelerate call."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

from accelkit import debug_launcher, utils


def test_device_probes_say_no_for_devices_accelkit_does_not_drive() -> None:
    for probe in (
        utils.is_xpu_available,
        utils.is_npu_available,
        utils.is_hpu_available,
        utils.is_mlu_available,
        utils.is_tpu_available,
        utils.is_torch_xla_available,
        utils.is_fp8_available,
    ):
        assert probe() is False, probe.__name__
    assert utils.is_cuda_available() is torch.cuda.is_available()
    assert utils.is_bf16_available() and utils.is_fp16_available()


def test_accelerator_and_distributed_backend_are_the_ones_accelkit_runs_on() -> None:
    """The pair a script reads (``device_type, device_module = get_torch_accelerator_backend()``)
    names the device PartialState picks, and the backend the one its process group gets; on a
    CPU or CUDA machine both are the reference's answers."""
    from accelkit.runtime.state import PartialState

    device_type, device_module = utils.get_torch_accelerator_backend()
    state = PartialState()
    assert torch.device(device_type or "cpu") == state.default_device
    assert state.device.type == (device_type or "cpu")
    assert device_module is (torch.cuda if torch.cuda.is_available() else None)
    built = utils.get_torch_accelerator_backend(check_available=False)
    assert built == (("cuda", torch.cuda) if torch.backends.cuda.is_built() else (None, None))
    assert (utils.get_distributed_backend(state.device.type) or "gloo") == state.backend
    # devices accelkit does not drive: no backend, as their is_*_available probes say no
    assert utils.get_distributed_backend("xpu") is None
    assert utils.get_distributed_backend("npu") is None

    reference = pytest.importorskip("accelerate.utils")
    if not hasattr(reference, "get_distributed_backend"):
        pytest.skip("accelerate before 1.16 has no get_distributed_backend")
    if torch.backends.mps.is_available():
        pytest.skip("the reference answers mps here; accelkit runs on the CPU")
    assert (device_type, device_module) == reference.get_torch_accelerator_backend()
    assert built == reference.get_torch_accelerator_backend(check_available=False)
    for device in ("cuda", "cpu", None):
        ours = utils.get_distributed_backend(device)
        assert ours == reference.get_distributed_backend(device), device


def test_package_probes_look_packages_up_without_importing_them() -> None:
    assert utils.is_pytest_available() is True
    assert utils.is_torch_version(">=", "2.0") and not utils.is_torch_version("<", "1.0")
    with pytest.raises(ValueError, match="Unknown operation '=>'"):
        utils.is_torch_version("=>", "2.0")


def test_small_helpers() -> None:
    assert utils.convert_file_size_to_int("10GB") == 10**10
    assert utils.convert_file_size_to_int("1GiB") == 2**30
    with pytest.raises(ValueError, match="Cannot read the size 'ten'"):
        utils.convert_file_size_to_int("ten")
    with utils.patch_environment(accelkit_probe_var="1"):
        assert os.environ["ACCELKIT_PROBE_VAR"] == "1"
    assert "ACCELKIT_PROBE_VAR" not in os.environ
    data = {"x": torch.ones(2, 3), "y": [torch.zeros(2)]}
    assert utils.find_batch_size(data) == 2
    assert utils.send_to_device(data, "cpu", skip_keys="y")["y"][0] is data["y"][0]
    structure = utils.get_data_structure(data)
    empty = utils.initialize_tensors(structure)
    assert empty["x"].shape == (2, 3) and empty["y"][0].dtype == torch.float32


def _record_rank(folder: str) -> None:
    from accelkit import PartialState

    state = PartialState()
    Path(folder, f"{state.process_index}-of-{state.num_processes}").write_text(str(state.device))


def test_debug_launcher_runs_the_function_on_cpu_processes(tmp_path: Path) -> None:
    debug_launcher(_record_rank, args=(str(tmp_path),), num_processes=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0-of-2", "1-of-2"]
    # Several CPU processes each use cpu:0, as Accelerate's do.
    assert {p.read_text() for p in tmp_path.iterdir()} == {"cpu:0"}


def _record_tagged(folder: str, tag: str, *, suffix: str) -> None:
    from accelkit import PartialState

    Path(folder, f"{tag}{PartialState().process_index}{suffix}").touch()


class _Recorder:
    """A callable object: it has no __name__, as a partial has none."""

    def __call__(self, folder: str) -> None:
        _record_tagged(folder, "object", suffix="")


def test_debug_launcher_runs_partials_and_callable_objects(tmp_path: Path) -> None:
    # Accelerate's debug_launcher runs any picklable callable; torch's agent reads the
    # entrypoint's __name__, which neither of these has.
    debug_launcher(functools.partial(_record_tagged, str(tmp_path), "partial", suffix=".x"))
    debug_launcher(_Recorder(), args=(str(tmp_path),), num_processes=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "object0",
        "object1",
        "partial0.x",
        "partial1.x",
    ]


def test_write_basic_config_writes_a_file_both_launchers_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from accelkit.launch.config import read_config_file

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    written = utils.write_basic_config("BF16")
    assert written == tmp_path / "hf" / "accelerate" / "default_config.yaml"
    settings = read_config_file(str(written))
    assert settings["mixed_precision"].value == "bf16"
    assert settings["num_processes"].value == max(torch.cuda.device_count(), 1)
    assert settings["cpu"].value is (torch.cuda.device_count() == 0)
    # Accelerate reads it too, as its own ClusterConfig.
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    theirs = config_args.load_config_from_file(str(written))
    assert theirs.mixed_precision == "bf16" and theirs.compute_environment.value == "LOCAL_MACHINE"
    # An existing file is kept.
    before = written.read_text()
    assert utils.write_basic_config("no", str(written)) is False
    assert written.read_text() == before
    assert "already exists" in capsys.readouterr().out
    with pytest.raises(ValueError, match="fp8"):
        utils.write_basic_config("fp8", str(tmp_path / "other.yaml"))
    assert not (tmp_path / "other.yaml").exists()


def test_checkpoint_file_names_are_the_references_and_two_are_accelkits_too() -> None:
    from accelkit.checkpointing.formats import layout

    assert (utils.WEIGHTS_NAME, utils.SAFE_WEIGHTS_NAME) == (
        "pytorch_model.bin",
        "model.safetensors",
    )
    assert utils.SAFE_WEIGHTS_PATTERN_NAME.format(suffix="-00001-of-00002") == (
        "model-00001-of-00002.safetensors"
    )
    # The docstring's claim: accelkit's model file and index have the reference's names.
    assert layout.model_file(0) == utils.SAFE_WEIGHTS_NAME
    assert layout.MODEL_INDEX_NAME == utils.SAFE_WEIGHTS_INDEX_NAME
