"""examples/s3_checkpoints.py against the real S3 server of the test suite (SeaweedFS)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.examples.runner import accelkit_command, launch, run
from tests.fixtures.s3 import ACCESS_KEY, SECRET_KEY, S3Server


def test_s3_example_saves_rotates_and_resumes_on_s3(
    s3_server: S3Server, s3_url: str, tmp_path: Path
) -> None:
    # Endpoint and credentials only through the environment, as the example's docstring says.
    env = {
        "AWS_ENDPOINT_URL": s3_server.endpoint_url,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    logs = tmp_path / "logs"
    args = ["--project_dir", s3_url, "--logging_dir", str(logs), "--keep", "1"]
    # One process keeps this test quick; the 2-process paths are covered by the quickstart test
    # and, on S3, by tests/checkpointing.
    first = launch("s3_checkpoints.py", *args, "--epochs", "2", processes=1, cwd=tmp_path, env=env)
    assert f"saved {s3_url}/checkpoints/checkpoint_1" in first.stdout
    assert "resumed from" not in first.stdout

    second = launch("s3_checkpoints.py", *args, "--epochs", "3", processes=1, cwd=tmp_path, env=env)
    assert f"resumed from {s3_url}/checkpoints/checkpoint_1 (epoch 2)" in second.stdout
    assert f"saved {s3_url}/checkpoints/checkpoint_2" in second.stdout

    # The CLI sees one committed checkpoint (total_limit=1 rotated the others after commit)...
    listing = run([*accelkit_command(), "ckpt", "ls", s3_url, "--json"], cwd=tmp_path, env=env)
    checkpoints = json.loads(listing.stdout)
    assert [(c["name"], c["state"]) for c in checkpoints] == [("checkpoint_2", "committed")]
    assert checkpoints[0]["world_size"] == 1
    assert set(checkpoints[0]["metrics"]) == {"loss"}
    # ...whose files all match the manifest's checksums.
    run([*accelkit_command(), "ckpt", "verify", s3_url], cwd=tmp_path, env=env)

    import s3fs

    fs = s3fs.S3FileSystem(**s3_server.storage_options, skip_instance_cache=True)
    assert fs.exists(f"{s3_url}/model/model.safetensors")
    # The logs stayed local.
    assert (logs / "s3_checkpoints" / "metrics.jsonl").is_file()
