"""``accelkit ckpt export CKPT OUT --format hf`` on checkpoints the real ``save_state`` wrote.

The command runs in-process through ``accelkit.cli.main.main``; what it wrote is read back
with the ``safetensors`` library (and, where installed, ``transformers.from_pretrained``).
Checked: the values bit for bit (and cast with ``--dtype``, integers untouched), tied names,
``--model``, the index of a sharded export, a damaged file or a bad CKPT leaving nothing
behind, an existing OUT refused unless ``--force``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from accelkit import Accelerator, ProjectConfiguration
from accelkit.cli.main import main


class _Tied(torch.nn.Module):
    """An embedding tied to the output layer, a float64 layer and an integer buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.body = torch.nn.Linear(8, 8).double()
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("ids", torch.arange(16))


def _save(project: Path) -> tuple[str, list[dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    accelerator = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=str(project), automatic_checkpoint_naming=True
        )
    )
    models = accelerator.prepare(_Tied(), torch.nn.Linear(3, 5))
    path = accelerator.save_state()
    return path, [{k: v.clone() for k, v in m.state_dict().items()} for m in models]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, torch.Tensor]]]:
    return _save(tmp_path_factory.mktemp("export"))


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["ckpt", "export", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_export_is_bit_for_bit_with_every_tied_name(
    saved: tuple[str, list[dict[str, torch.Tensor]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, states = saved
    code, out, err = _cli(capsys, path, str(tmp_path / "hf"), "--format", "hf")
    assert code == 0, err
    assert "head.weight = embed.weight" in out
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors"]
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}  # from_pretrained refuses a file without it
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == states[0].keys()
    for name, value in states[0].items():
        assert exported[name].dtype == value.dtype
        assert torch.equal(
            exported[name].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)
        )
    assert _leftovers(tmp_path) == []

    code, out, err = _cli(capsys, path, str(tmp_path / "second"), "--model", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["files"] == ["model.safetensors"]
    second = load_file(tmp_path / "second" / "model.safetensors")
    assert second.keys() == states[1].keys()
    assert all(torch.equal(second[k], v) for k, v in states[1].items())


def test_dtype_casts_floats_only(
    saved: tuple[str, list[dict[str, torch.Tensor]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, states = saved
    code, _, err = _cli(capsys, path, str(tmp_path / "bf16"), "--dtype", "bfloat16")
    assert code == 0, err
    exported = load_file(tmp_path / "bf16" / "model.safetensors")
    for name, value in states[0].items():
        want = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert exported[name].dtype == want.dtype, name
        assert torch.equal(exported[name], want), name


def test_sharded_export_writes_a_transformers_index(
    saved: tuple[str, list[dict[str, torch.Tensor]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, states = saved
    out = tmp_path / "shards"
    code, _, err = _cli(capsys, path, str(out), "--max-shard-size", "300B")
    assert code == 0, err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"].keys() == states[0].keys()
    assert index["metadata"]["total_size"] == sum(
        v.numel() * v.element_size() for v in states[0].values()
    )
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in out.iterdir()) == [*files, "model.safetensors.index.json"]
    for file in files:
        part = load_file(out / file)
        assert sorted(part) == sorted(n for n, f in index["weight_map"].items() if f == file)
        assert all(torch.equal(t, states[0][n]) for n, t in part.items())


def test_bad_input_is_refused_and_leaves_nothing(
    saved: tuple[str, list[dict[str, torch.Tensor]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, _ = saved
    out = tmp_path / "out"
    code, _, err = _cli(capsys, str(tmp_path / "nope"), str(out))
    assert code == 2 and "does not exist" in err
    code, _, err = _cli(capsys, path, str(out), "--model", "7")
    assert code == 2 and "model 7 is not in" in err and "model(s) 0, 1" in err
    assert not out.exists() and _leftovers(tmp_path) == []

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = _cli(capsys, path, str(out))
    assert code == 2 and "is not empty" in err and "--force" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    code, _, err = _cli(capsys, path, str(out), "--force")
    assert code == 0, err
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    assert _leftovers(tmp_path) == []


def test_force_never_replaces_the_checkpoint_or_its_project(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator's slip: OUT is the project, the checkpoint itself, or a folder inside it.
    With --force the export would move it aside and delete it with the checkpoints."""
    project = tmp_path / "project"
    path, _ = _save(project)
    before = sorted(str(p.relative_to(project)) for p in project.rglob("*"))
    for out in (project, Path(path), Path(path) / "hf"):
        code, _, err = _cli(capsys, str(project), str(out), "--force")
        assert code == 2 and "overlaps the checkpoint being exported" in err, (out, err)
    assert sorted(str(p.relative_to(project)) for p in project.rglob("*")) == before
    assert _leftovers(project) == [] and _leftovers(tmp_path) == []


def test_a_damaged_file_fails_the_export_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = _save(tmp_path / "project")
    weights = Path(path) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # the last tensor byte: found only by the checksum, after every tensor
    weights.write_bytes(bytes(data))
    code, _, err = _cli(capsys, path, str(tmp_path / "hf"))
    assert code == 1 and "checksum" in err and "model.safetensors" in err
    assert not (tmp_path / "hf").exists() and _leftovers(tmp_path) == []


@pytest.mark.slow
def test_transformers_from_pretrained_gives_the_same_outputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=16,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    accelerator = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=str(tmp_path / "p"), automatic_checkpoint_naming=True
        )
    )
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    tokens = torch.randint(0, 64, (2, 8))
    accelerator.backward(model(tokens, labels=tokens).loss)
    optimizer.step()
    path = accelerator.save_state()
    out = tmp_path / "hf"
    # A sharded export, so from_pretrained reads the index too.
    code, _, err = _cli(capsys, path, str(out), "--max-shard-size", "4KB")
    assert code == 0, err
    assert (out / "model.safetensors.index.json").exists()
    config.save_pretrained(out)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
