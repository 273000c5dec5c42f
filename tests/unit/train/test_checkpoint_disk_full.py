"""A full disk during a checkpoint (issue 26, item 13): the partial ``step-N.tmp`` is removed (it kept the disk full
for the retry), an earlier save's leftover ``.tmp`` is removed by the next save, and ENOSPC is a DiskFullError that
a flow retry does not repeat. The ENOSPC is the kernel's own: a write to ``/dev/full``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from grpo_core.errors import DiskFullError, is_deterministic
from grpo_core.train import checkpoint
from grpo_core.transport.types import ResumeState

pytestmark = pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-rank gloo process group (what ``checkpoint.save`` runs in)."""
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _objects():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    model(torch.randn(4, 6)).square().sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def _write_to_dev_full() -> None:
    with open("/dev/full", "wb") as f:  # every write to it fails with ENOSPC
        f.write(b"x" * 4096)
        f.flush()


def _save(tmp_path: Path, step: int) -> Path:
    model, optimizer, scheduler = _objects()
    path = checkpoint.checkpoint_dir(tmp_path, step)
    checkpoint.save(path, model, optimizer, scheduler, ResumeState(step, step, 0, [], 0), None, rank=0)
    return path


def _full_after_first_dcp_item(monkeypatch) -> list[int]:
    """DCP writes its first item, then the disk is full (the kernel's ENOSPC)."""
    from torch.distributed.checkpoint import filesystem

    real, calls = filesystem._write_item, []

    def write_item(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            _write_to_dev_full()
        return real(*args, **kwargs)

    monkeypatch.setattr(filesystem, "_write_item", write_item)
    return calls


def _full_at_the_rng_file(monkeypatch) -> list[int]:
    """The DCP folder is written, then the RNG file meets a full disk."""
    real, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(1)
        real(obj, f, *args, **kwargs)  # the file is there (and takes space) when the disk fills up
        _write_to_dev_full()

    monkeypatch.setattr(checkpoint.torch, "save", save)
    return calls


@pytest.mark.parametrize("fill", [_full_after_first_dcp_item, _full_at_the_rng_file])
def test_a_full_disk_leaves_no_partial_checkpoint_and_is_not_retried(group, tmp_path, monkeypatch, fill):
    first = _save(tmp_path, 1)
    calls = fill(monkeypatch)
    with pytest.raises(DiskFullError, match=r"no space left for checkpoint step 2 .*No space left on device") as info:
        _save(tmp_path, 2)
    assert calls, "the full disk was never reached"
    assert is_deterministic(info.value) and is_deterministic("DiskFullError")
    assert not is_deterministic("OSError")  # any other OSError stays curable (a network share that came back)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [first.name]  # no step-0000002.tmp
    assert checkpoint.latest_checkpoint(tmp_path) == first


def test_the_next_save_removes_a_partial_checkpoint_an_earlier_save_left(group, tmp_path):
    """A save killed mid-write (SIGKILL, power) leaves ``step-N.tmp``; the next save removes it."""
    left = checkpoint.checkpoint_dir(tmp_path, 3).with_name("step-0000003.tmp")
    (left / "dcp").mkdir(parents=True)
    (left / "dcp" / "__0_0.distcp").write_bytes(b"\0" * 65536)
    saved = _save(tmp_path, 4)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [saved.name]
    assert checkpoint.verify(saved) is None


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """``tmp_path/checkpoints`` on a real 512 KiB tmpfs (root only; skipped where mounting is not allowed)."""
    import os
    import subprocess

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_a_full_tmpfs_that_torch_reports_as_a_bad_zip_position_is_a_full_disk(group, tmp_path, tiny_tmpfs):
    """On a real full filesystem torch's zip writer loses the ENOSPC and raises ``RuntimeError: ... unexpected pos``
    (DCP wraps it in a CheckpointException, not an Exception): the save must still say the disk is full."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)  # 257 KiB of parameters, 3 times that with AdamW's two moments: > 512 KiB
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    path = checkpoint.checkpoint_dir(tmp_path, 1)
    with pytest.raises(
        DiskFullError, match=r"no space left for checkpoint step 1 .*bytes free there.*RuntimeError"
    ) as info:
        checkpoint.save(path, model, optimizer, scheduler, ResumeState(1, 1, 0, [], 0), None, rank=0)
    assert is_deterministic(info.value)
    assert list(tiny_tmpfs.iterdir()) == []  # the partial step-0000001.tmp is gone
