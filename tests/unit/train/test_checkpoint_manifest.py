"""Restoring a checkpoint never unpickles code (issue 11, item 2): every file is checked against the SHA-256
digests of its ``manifest.json`` before anything is read, tensors load with ``weights_only=True``, and DCP's
pickled metadata goes through a restricted unpickler. Issue 26, item 2: DCP pickles every non-tensor value
(an AdamW's lr, betas, ...) and its default planner unpickles them on load; now they are JSON, and a checkpoint
listing a pickled item is refused unread even with a manifest that matches."""

from __future__ import annotations

import hashlib
import io
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
@pytest.mark.parametrize(
    "name", ["dcp/.metadata", "rng_rank0.pt", "scheduler.json", "nontensor_state.json", "rollout_state.json"]
)
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


def _optimizer_after_two_steps():
    model, optimizer, scheduler = _objects(0)
    for _ in range(2):
        model(torch.randn(4, 6)).square().sum().backward()
        optimizer.step()
        scheduler.step()
    return model, optimizer, scheduler


def test_a_resume_restores_the_optimizer_and_scheduler_exactly_and_nothing_is_pickled(saved):
    """Every optimizer value (tensors and the param groups' lr, betas, ... with their types) and the scheduler
    come back equal to the saved objects (rebuilt here from the same seed); the DCP folder lists tensors only."""
    import torch.distributed.checkpoint as dcp

    from grpo_core.train.plain_state import bytes_items

    path, _ = saved
    torch.manual_seed(0)  # the fixture's batches: the same two steps give the saved objects again
    _, want_opt, want_sched = _optimizer_after_two_steps()
    model, optimizer, scheduler = _objects(1)
    assert optimizer.param_groups[0]["lr"] != want_opt.param_groups[0]["lr"]  # a real change is needed
    checkpoint.load(path, model, optimizer, scheduler, rank=0)
    got, want = optimizer.state_dict(), want_opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert type(got["param_groups"][0]["betas"]) is tuple
    assert got["state"].keys() == want["state"].keys()
    for i, per_param in want["state"].items():
        for name, value in per_param.items():
            assert torch.equal(got["state"][i][name], value), (i, name)
    assert scheduler.state_dict() == want_sched.state_dict()
    assert bytes_items(dcp.FileSystemReader(str(path / "dcp")).read_metadata()) == []


class _Payload:
    """Unpickles as a call of ``open(marker, "w")``: it creates the marker file (what a forged optimizer value
    could run instead)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("key", ["lr", "params"])
def test_a_checkpoint_whose_bytes_item_carries_a_pickle_is_refused_and_the_payload_never_runs(saved, tmp_path, key):
    """The forger writes the DCP folder with DCP itself (the optimizer's param group value replaced by a payload)
    and rewrites the manifest to match: verify() and load() refuse it, naming the item, and the payload never ran
    (the old loader unpickled it with torch.load(weights_only=False) and created the file)."""
    import shutil

    import torch.distributed.checkpoint as dcp

    path, _ = saved
    marker = tmp_path / "payload-ran"
    model, optimizer, _ = _optimizer_after_two_steps()
    sd = checkpoint._state_dicts(model, optimizer, checkpoint._state_dict_options(model))
    sd["optim"]["param_groups"][0][key] = _Payload(marker)
    shutil.rmtree(path / "dcp")
    dcp.save(sd, checkpoint_id=str(path / "dcp"))
    assert not marker.exists()  # saving pickled it; nothing ran yet
    write_manifest(path)
    verify_manifest(path)  # the manifest proves nothing against whoever can rewrite it
    assert f"optim.param_groups.0.{key}" in (checkpoint.verify(path) or "")
    assert checkpoint.latest_checkpoint(path.parent.parent) is None  # skipped as damaged, never loaded
    model, optimizer, scheduler = _objects(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"optim\.param_groups\.0\.{key}.*which DCP would unpickle"):
        checkpoint.load(path, model, optimizer, scheduler, rank=0)
    assert not marker.exists()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_planner_refuses_a_bytes_item_even_if_the_metadata_check_were_passed():
    from types import SimpleNamespace

    from grpo_core.train.plain_state import tensor_only_planner

    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="optim.param_groups.0.lr"))
    with pytest.raises(CheckpointError, match="optim.param_groups.0.lr is pickled bytes"):
        tensor_only_planner().load_bytes(item, io.BytesIO(pickle.dumps(_Payload(Path("/nonexistent/x")))))


def test_state_values_round_trip_as_json_with_their_types():
    from grpo_core.train.plain_state import from_json, to_json

    values = {"betas": (0.9, 0.999), "lr": 1e-3, "eps": float("inf"), "names": ["a.b", "c"], "none": None, "ok": True}
    back = from_json(to_json(values), "x")
    assert back == values and type(back["betas"]) is tuple and type(back["ok"]) is bool
    with pytest.raises(CheckpointError, match=r"checkpoint state dtype is a dtype"):
        to_json({"dtype": torch.float32})
