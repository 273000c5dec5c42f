"""Restoring a checkpoint never unpickles code (issue 11, item 2): every file is checked against the SHA-256
digests of its ``manifest.json`` before anything is read, tensors load with ``weights_only=True``, and DCP's
pickled metadata goes through a restricted unpickler."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from grpo_core.errors import CheckpointError
from grpo_core.train import checkpoint
from grpo_core.train.manifest import MANIFEST_FILE, read_dcp_metadata, verify_manifest, write_manifest
from grpo_core.transport.types import ResumeState


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-rank gloo process group (what ``checkpoint.save``/``load`` run in)."""
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _objects(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    return model, optimizer, scheduler


@pytest.fixture
def saved(group, tmp_path):
    """A checkpoint after two optimizer steps; returns its folder and the model's weights then."""
    model, optimizer, scheduler = _objects(0)
    for _ in range(2):
        model(torch.randn(4, 6)).square().sum().backward()
        optimizer.step()
        scheduler.step()
    path = checkpoint.checkpoint_dir(tmp_path, 2)
    checkpoint.save(path, model, optimizer, scheduler, ResumeState(1, 2, 7, [9], 0), None, rank=0)
    return path, {k: v.clone() for k, v in model.state_dict().items()}


def test_manifest_lists_the_sha256_of_every_file(saved):
    path, _ = saved
    listed = json.loads((path / MANIFEST_FILE).read_text())["files"]
    on_disk = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    assert sorted(listed) == on_disk and "dcp/.metadata" in listed and "rng_rank0.pt" in listed
    for name, digest in listed.items():
        assert hashlib.sha256((path / name).read_bytes()).hexdigest() == digest


def test_a_verified_checkpoint_restores_weights_rng_and_state(saved):
    path, weights = saved
    rng_saved = torch.load(path / "rng_rank0.pt", weights_only=True)["cpu"]
    model, optimizer, scheduler = _objects(1)
    state, pending = checkpoint.load(path, model, optimizer, scheduler, rank=0)
    assert (state.step, state.policy_version, state.first_untrained_prompt_index) == (2, 1, 7) and pending is None
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name])
    assert torch.equal(torch.get_rng_state(), rng_saved) and scheduler.last_epoch == 2


@pytest.mark.parametrize("damage", ["change", "delete", "add", "no-manifest"])
@pytest.mark.parametrize("name", ["dcp/.metadata", "rng_rank0.pt", "scheduler.pt", "rollout_state.json"])
def test_a_tampered_or_missing_file_is_refused_naming_it(saved, damage, name):
    path, _ = saved
    target = path / name
    if damage == "change":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    elif damage == "delete":
        target.unlink()
    elif damage == "add":
        target = path / "dcp" / "extra.pt"
        target.write_bytes(b"x")
        name = "dcp/extra.pt"
    else:
        (path / MANIFEST_FILE).unlink()
        name = MANIFEST_FILE
    model, optimizer, scheduler = _objects(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        checkpoint.load(path, model, optimizer, scheduler, rank=0)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing was loaded


class _Plant:
    """Pickles as a call of ``pathlib.Path.touch`` on a marker: what a forged metadata file could carry."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_forged_metadata_with_a_matching_manifest_runs_no_code(saved, tmp_path):
    """Even with its manifest rewritten to match, a metadata pickle that names code is refused unrun."""
    path, _ = saved
    marker = tmp_path / "ran"
    (path / "dcp" / ".metadata").write_bytes(pickle.dumps(_Plant(marker)))
    write_manifest(path)
    verify_manifest(path)
    model, optimizer, scheduler = _objects(1)
    with pytest.raises(CheckpointError, match="pathlib.Path.touch|refused"):
        checkpoint.load(path, model, optimizer, scheduler, rank=0)
    assert not marker.exists()
    for payload in (pickle.dumps(eval), pickle.dumps(torch.load), pickle.dumps(print)):
        with pytest.raises(CheckpointError, match="refused"):
            read_dcp_metadata(payload)
