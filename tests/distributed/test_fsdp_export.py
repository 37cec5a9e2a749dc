"""``accelkit ckpt export`` of an FSDP2 checkpoint (the model in ``sharded/``, written by DCP).

One real 2-process FSDP2 job on gloo (CPU) trains a step and saves with ``save_state``, and
gathers the model's full state dict (what ``save_model`` would write). Everything else runs
here, in one process with no process group, as the command does: the export's weights equal
the gathered ones (bit for bit, and cast with ``--dtype``), the index of a sharded export,
and crafted or truncated sharded files refused by name with nothing left at OUT.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from accelkit.checkpointing.formats.dcp_metadata import parse_metadata
from accelkit.checkpointing.formats.manifest import read_manifest, write_manifest
from accelkit.checkpointing.storage import get_storage
from accelkit.checkpointing.storage.checksum import checksum_bytes, parse_checksum
from accelkit.cli.main import main
from tests.helpers.distributed import run_distributed

VOCAB, DIM = 17, 8  # an odd number of rows: the two processes hold chunks of 9 and 8 rows


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 3 * DIM)
        self.down = nn.Linear(3 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, 5)
        self.register_buffer("ids", torch.arange(7))  # an integer buffer, not cast

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _job(project: str) -> dict[str, Any]:
    from accelkit import Accelerator, ProjectConfiguration
    from accelkit.fsdp.runtime import FullyShardedDataParallelPlugin

    accelerator = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]),
        project_config=ProjectConfiguration(project, automatic_checkpoint_naming=True),
    )
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    tokens = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(1))
    accelerator.backward(model(tokens).square().mean())
    optimizer.step()
    optimizer.zero_grad()
    saved = accelerator.save_state()
    full = {k: v.detach().clone() for k, v in accelerator.get_state_dict(model).items()}
    return {"saved": saved, "full": full}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    project = tmp_path_factory.mktemp("fsdp-export") / "run"
    r0, _ = run_distributed(_job, str(project), world_size=2, timeout=240)
    full = r0["full"]
    assert full and "embed.weight" in full and "ids" in full  # gathered on the main process
    return Path(r0["saved"]), full


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["ckpt", "export", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_export_equals_the_gathered_state_dict(
    saved: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, full = saved
    assert sorted(p.name for p in (path / "sharded").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert not (path / "model.safetensors").exists()
    code, out, err = _cli(capsys, str(path), str(tmp_path / "hf"), "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["files"] == ["model.safetensors"] and result["tensors"] == len(full)
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == full.keys()
    for name, value in full.items():
        assert exported[name].dtype == value.dtype, name
        assert torch.equal(exported[name], value), name
    assert _leftovers(tmp_path) == []

    code, _, err = _cli(capsys, str(path), str(tmp_path / "bf16"), "--dtype", "bfloat16")
    assert code == 0, err
    cast = load_file(tmp_path / "bf16" / "model.safetensors")
    for name, value in full.items():
        want = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert cast[name].dtype == want.dtype, name
        assert torch.equal(cast[name], want), name


def test_max_shard_size_writes_shards_and_an_index(
    saved: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, full = saved
    out = tmp_path / "shards"
    code, _, err = _cli(capsys, str(path), str(out), "--max-shard-size", "1KB")
    assert code == 0, err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"].keys() == full.keys()
    assert index["metadata"]["total_size"] == sum(
        v.numel() * v.element_size() for v in full.values()
    )
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in out.iterdir()) == [*files, "model.safetensors.index.json"]
    for file in files:
        part = load_file(out / file)
        assert sorted(part) == sorted(n for n, f in index["weight_map"].items() if f == file)
        assert all(torch.equal(t, full[n]) for n, t in part.items())


# ------------------------------------------------------------------ damaged and crafted


def _copy(path: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(path, copy)
    return copy


def _rewrite(folder: Path, relative: str, data: bytes) -> None:
    """Replace a file of the checkpoint and its manifest entry, as a crafted checkpoint would
    (so the manifest's check alone does not catch it)."""
    (folder / relative).write_bytes(data)
    storage = get_storage(str(folder))
    manifest = read_manifest(storage, str(folder))
    assert manifest is not None
    files = []
    for entry in manifest.files:
        if entry.path == relative:
            algorithm, _ = parse_checksum(entry.checksum)
            entry = dataclasses.replace(
                entry, size=len(data), checksum=checksum_bytes(data, algorithm)
            )
        files.append(entry)
    manifest.files = files
    write_manifest(storage, str(folder), manifest)


def _metadata(folder: Path) -> Any:
    url = str(folder / "sharded" / ".metadata")
    return parse_metadata(Path(url).read_bytes(), url)


def _drop_chunk(metadata: Any) -> str:
    item = metadata.state_dict_metadata["model.embed.weight"]
    item.chunks = item.chunks[:1]
    return "a chunk is missing"


def _moved_chunk(metadata: Any) -> str:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    item = metadata.state_dict_metadata["model.embed.weight"]
    first, second = item.chunks
    item.chunks = [first, ChunkStorageMetadata(torch.Size([4, 0]), second.sizes)]
    return "no storage entry"  # a moved chunk no longer names its bytes


def _past_the_end(metadata: Any) -> str:
    for index, info in metadata.storage_data.items():
        if index.fqn == "model.embed.weight":
            info.offset += 10**6  # past every other range: only the file's end stops it
    return "past the file's end"


def _not_tiling(metadata: Any) -> str:
    item = metadata.state_dict_metadata["model.embed.weight"]
    item.size = torch.Size([VOCAB + 3, DIM])
    return "a chunk is missing"


@pytest.mark.parametrize("craft", [_drop_chunk, _moved_chunk, _past_the_end, _not_tiling])
def test_crafted_metadata_is_refused_by_name_and_leaves_nothing(
    saved: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    craft: Any,
) -> None:
    folder = _copy(saved[0], tmp_path)
    metadata = _metadata(folder)
    why = craft(metadata)
    _rewrite(folder, "sharded/.metadata", pickle.dumps(metadata))
    out = tmp_path / "hf"
    code, _, err = _cli(capsys, str(folder), str(out))
    assert code == 1, err
    assert "'model.embed.weight'" in err and why in err, err
    assert not out.exists() and _leftovers(tmp_path) == []


def test_overlapping_chunks_are_refused(
    saved: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two chunks claiming the same rows (each with its storage entry) would write one
    place twice and leave another unwritten."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    folder = _copy(saved[0], tmp_path)
    metadata = _metadata(folder)
    item = metadata.state_dict_metadata["model.embed.weight"]
    first, second = item.chunks
    moved = torch.Size([first.sizes[0] - 1, 0])
    item.chunks = [first, ChunkStorageMetadata(moved, second.sizes)]
    for index in list(metadata.storage_data):
        if index.fqn == "model.embed.weight" and tuple(index.offset) == tuple(second.offsets):
            info = metadata.storage_data.pop(index)
            metadata.storage_data[MetadataIndex(index.fqn, moved)] = info
    _rewrite(folder, "sharded/.metadata", pickle.dumps(metadata))
    code, _, err = _cli(capsys, str(folder), str(tmp_path / "hf"))
    assert code == 1 and "'model.embed.weight'" in err and "overlap" in err, err
    assert not (tmp_path / "hf").exists() and _leftovers(tmp_path) == []


def test_truncated_or_damaged_shard_file_is_refused_and_leaves_nothing(
    saved: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Truncated behind the manifest's back: the manifest's size check names the file.
    folder = _copy(saved[0], tmp_path)
    shard = folder / "sharded" / "__1_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    code, _, err = _cli(capsys, str(folder), str(tmp_path / "hf"))
    assert code == 1 and "__1_0.distcp" in err, err
    # Truncated inside a model tensor's bytes, with a manifest that agrees: the byte ranges
    # name the file and the tensor. (The model's chunks come first in a file; cutting off
    # only the optimizer's state behind them does not stop an export of the model.)
    ends = [
        info.offset + info.length
        for index, info in _metadata(folder).storage_data.items()
        if index.fqn.startswith("model.") and info.relative_path == "__1_0.distcp"
    ]
    _rewrite(folder, "sharded/__1_0.distcp", data[: max(ends) - 1])
    code, _, err = _cli(capsys, str(folder), str(tmp_path / "hf"))
    assert code == 1 and "__1_0.distcp" in err and "tensor 'model." in err, err
    assert "truncated" in err
    # One flipped bit in a tensor's data: torch.load reads it happily; only the checksum,
    # checked as the file is read, finds it.
    shutil.rmtree(folder)
    folder = _copy(saved[0], tmp_path)
    shard = folder / "sharded" / "__0_0.distcp"
    damaged = bytearray(shard.read_bytes())
    metadata = _metadata(folder)
    (chunk,) = [
        c for c in metadata.state_dict_metadata["model.embed.weight"].chunks if not c.offsets[0]
    ]
    rows = saved[1]["embed.weight"][: chunk.sizes[0]].numpy().tobytes()
    at = damaged.find(rows)
    assert at > 0
    damaged[at + 1] ^= 0x01
    shard.write_bytes(bytes(damaged))
    code, _, err = _cli(capsys, str(folder), str(tmp_path / "hf"))
    assert code == 1 and "__0_0.distcp" in err and "checksum" in err, err
    assert not (tmp_path / "hf").exists() and _leftovers(tmp_path) == []


# ------------------------------------------------------------------ memory


ROWS, COLS, LAYERS = 2048, 4096, 6  # six 32 MiB weights: 192 MiB of model, 16 MiB chunks


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(COLS, ROWS, bias=False) for _ in range(LAYERS))


def _wide_job(project: str) -> str:
    from accelkit import Accelerator, ProjectConfiguration
    from accelkit.fsdp.runtime import FullyShardedDataParallelPlugin

    accelerator = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Linear"]),
        project_config=ProjectConfiguration(project, automatic_checkpoint_naming=True),
    )
    torch.manual_seed(0)
    accelerator.prepare(Wide())
    return str(accelerator.save_state())


_MEMORY_SCRIPT = """
import json, sys
import torch
import torch.distributed.checkpoint.metadata  # imports are not the export's memory
from accelkit.checkpointing.formats import _torch_pickle, dcp_chunks  # noqa: F401
from accelkit.checkpointing.interop.hf_export import export_hf
from tests.helpers.memory import peak_kib

before = peak_kib()
result = export_hf(sys.argv[1], sys.argv[2], dtype="bfloat16")
print(json.dumps({"grown_kib": peak_kib() - before, "total": result.total_size}))
"""


@pytest.mark.slow
def test_export_memory_is_about_one_chunk_not_the_model(tmp_path: Path) -> None:
    """The export holds one chunk at a time (its bytes and its tensor), not the model: a
    192 MiB model of 32 MiB weights saved by 2 processes exports within 32 MiB + 96 MiB."""
    import subprocess
    import sys

    (saved,) = {run_distributed(_wide_job, str(tmp_path / "run"), timeout=240)[0]}
    out = tmp_path / "hf"
    done = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, saved, str(out)],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    model = LAYERS * ROWS * COLS * 4
    assert report["total"] == model // 2  # cast to bfloat16
    # Measured here: ~92 MiB (a 16 MiB chunk as bytes and as a tensor, a cast piece, the
    # file reads' buffers, the allocator's slack); the whole model would be 192 MiB or more.
    assert report["grown_kib"] * 1024 < ROWS * COLS * 4 + 96 * 2**20 < model, report
    assert (out / "model.safetensors").stat().st_size > model // 2


# ------------------------------------------------------------------ transformers


def _gpt2_config() -> Any:
    import transformers

    return transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=16,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )


def _gpt2_job(project: str) -> dict[str, Any]:
    import transformers

    from accelkit import Accelerator, ProjectConfiguration
    from accelkit.fsdp.runtime import FullyShardedDataParallelPlugin

    accelerator = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["GPT2Block"]),
        project_config=ProjectConfiguration(project, automatic_checkpoint_naming=True),
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_gpt2_config())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    accelerator.backward(model(tokens, labels=tokens).loss)
    optimizer.step()
    saved = accelerator.save_state()
    model.eval()
    with torch.no_grad():
        logits = model(tokens).logits
    return {"saved": saved, "tokens": tokens, "logits": logits}


@pytest.mark.slow
def test_transformers_from_pretrained_loads_an_fsdp2_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    r0, _ = run_distributed(_gpt2_job, str(tmp_path / "run"), timeout=240)
    out = tmp_path / "hf"
    code, _, err = _cli(capsys, r0["saved"], str(out), "--max-shard-size", "8KB")
    assert code == 0, err
    assert (out / "model.safetensors.index.json").exists()
    _gpt2_config().save_pretrained(out)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    with torch.no_grad():
        logits = loaded(r0["tokens"]).logits
    assert torch.allclose(logits, r0["logits"], atol=1e-5)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_export_from_an_fsspec_url_and_a_metadata_changed_behind_the_manifest(
    saved: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import fsspec

    path, full = saved
    memory = fsspec.filesystem("memory")
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        memory.pipe(f"/fsdp-export/ckpt/{file.relative_to(path).as_posix()}", file.read_bytes())
    try:
        code, _, err = _cli(capsys, "memory://fsdp-export/ckpt", str(tmp_path / "hf"))
        assert code == 0, err
    finally:
        memory.rm("/fsdp-export", recursive=True)
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == full.keys()
    assert all(torch.equal(exported[k], v) for k, v in full.items())

    # DCP's index is checked against its manifest entry before it is unpickled.
    folder = _copy(path, tmp_path)
    metadata = _metadata(folder)
    _drop_chunk(metadata)
    (folder / "sharded" / ".metadata").write_bytes(pickle.dumps(metadata))
    code, _, err = _cli(capsys, str(folder), str(tmp_path / "again"))
    assert code == 1 and ".metadata" in err, err
    assert not (tmp_path / "again").exists() and _leftovers(tmp_path) == []
