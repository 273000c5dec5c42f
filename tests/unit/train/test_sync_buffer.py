"""The vLLM full-weight sync's persistent packed buffer (issue 25, item 5): gathered before any pause, allocated once,
read back bit-exactly by vLLM's packed consumer rule, one round trip per replica in parallel.

The servers are the fake generation server (tests/support/fake_generation.py: every request with its arrival
number); the gather is observed by wrapping ``PackedWeights.gather``, so the order of gather and pauses is the order
events arrived. What a vLLM 0.25.1
server does with the bytes is written out from its source (``vllm/distributed/weight_transfer/packed_tensor.py``,
``unpack_tensor``: split the buffer by ``tensor_sizes`` in ``names`` order, read each piece as its dtype and shape),
independently of the trainer's layout code. No CUDA here: the IPC handle is a stand-in naming the buffer's address.
"""

from __future__ import annotations

import base64
import itertools
import pickle
import sys
import time
import types

import pytest
import torch
from fake_generation import ARRIVALS, FakeGeneration

from grpo_core.errors import ServingError
from grpo_core.serving.protocol import UPDATE_WEIGHTS_PATH
from grpo_core.train.weight_sync import vllm as vllm_sync
from grpo_core.train.weight_sync.sync_buffer import PackedWeights
from grpo_core.train.weight_sync.vllm import VllmWeightTransferSync

CLEANUP = ["/finish_weight_update", "/reset_prefix_cache", "/resume"]


def paths(server: FakeGeneration) -> list[str]:
    """The routes of every POST ``server`` received, in order."""
    return [route for route, _ in server.posts()]


def arrival(server: FakeGeneration, route: str) -> list[int]:
    """Arrival numbers (:data:`fake_generation.ARRIVALS`) of the requests ``server`` received on ``route``."""
    return [r.number for r in server.calls(route)]


@pytest.fixture
def servers():
    """Makes recording vLLM servers: the fake generation server (tests/support/fake_generation.py)."""
    made: list[FakeGeneration] = []

    def make() -> FakeGeneration:
        made.append(FakeGeneration().start())
        return made[-1]

    yield make
    for s in made:
        s.stop()


class TiedPolicy(torch.nn.Module):
    """bf16 and fp32 parameters of odd sizes (a bf16 piece before an fp32 one would misalign it), an output head
    tied to the embedding (``named_parameters`` lists it once), under the trainer's ``lm.`` prefix."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = torch.nn.Module()
        self.lm.embed_tokens = torch.nn.Embedding(7, 3).to(torch.bfloat16)
        self.lm.norm = torch.nn.LayerNorm(3)  # fp32: weight and bias of 3 elements (12 bytes)
        self.lm.q_proj = torch.nn.Linear(3, 5).to(torch.bfloat16)  # bias: 5 elements, 10 bytes
        self.lm.lm_head = torch.nn.Linear(3, 7, bias=False).to(torch.bfloat16)
        self.lm.lm_head.weight = self.lm.embed_tokens.weight
        self.lm.scale = torch.nn.Parameter(torch.randn(1, dtype=torch.float64))  # 8-byte elements
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, dtype=torch.float64).to(p.dtype))

    def perturb(self, step: int) -> None:
        with torch.no_grad():
            for p in self.parameters():
                p.add_(torch.full_like(p, 0.5 * step))


def vllm_unpack(buffer: torch.Tensor, info: dict) -> dict[str, torch.Tensor]:
    """What a vLLM 0.25.1 server reads from a packed update (``packed_tensor.unpack_tensor``): the buffer split by
    ``tensor_sizes`` in ``names`` order, each piece viewed as its dtype (which needs its offset to be a multiple of the
    dtype's size, or ``view`` raises) and shape."""
    pieces = buffer[: sum(info["tensor_sizes"])].split(info["tensor_sizes"])
    return {
        name: piece.contiguous().view(getattr(torch, dtype)).view(*shape)
        for name, dtype, shape, piece in zip(info["names"], info["dtype_names"], info["shapes"], pieces)
    }


def fake_ipc(monkeypatch) -> list[torch.Tensor]:
    """Stand-in for the CUDA IPC handle (no GPU here): names the buffer's address and size; returns the buffers it
    was asked for."""
    asked: list[torch.Tensor] = []

    def handle(buffer: torch.Tensor) -> dict[str, tuple]:
        asked.append(buffer)
        return {"GPU-test-uuid": ("ipc", buffer.data_ptr(), buffer.numel())}

    monkeypatch.setattr(vllm_sync, "cuda_ipc_handle", handle)
    return asked


def record_gathers(monkeypatch) -> list[int]:
    """Arrival numbers of every gather into the packed buffer (the same counter as the servers' requests)."""
    gathers: list[int] = []
    original = PackedWeights.gather

    def gather(self, policy) -> None:
        gathers.append(next(ARRIVALS))
        original(self, policy)

    monkeypatch.setattr(PackedWeights, "gather", gather)
    return gathers


def test_the_buffer_reproduces_every_weight_bit_exactly_as_vllm_unpacks_it():
    policy = TiedPolicy()
    weights = PackedWeights.for_policy(policy, lambda name: name.removeprefix("lm."))
    weights.gather(policy)
    info = weights.update_fields()
    # the buffer holds each distinct parameter once, no padding: its size is the sum the math gives
    distinct = {p.data_ptr(): p for p in policy.parameters()}.values()
    assert weights.buffer.dtype == torch.uint8
    assert weights.buffer.numel() == sum(p.numel() * p.element_size() for p in distinct) == sum(info["tensor_sizes"])
    assert {str(p.dtype) for p in distinct} == {"torch.bfloat16", "torch.float32", "torch.float64"}  # the set-up
    served = vllm_unpack(weights.buffer, info)
    state = policy.state_dict()
    assert "lm.lm_head.weight" in state and "lm_head.weight" not in served  # tied: sent once, re-tied by the server
    for key, tensor in state.items():
        name = key.removeprefix("lm.")
        if name == "lm_head.weight":
            name = "embed_tokens.weight"
        assert served[name].dtype == tensor.dtype and torch.equal(served[name], tensor), key
    # the trainer's own views and per-dtype flat tensors are the same bytes
    for name, view in weights.views():
        assert torch.equal(view, served[name]) and view.data_ptr() == served[name].data_ptr()
    assert set(weights.flat) == {torch.bfloat16, torch.float32, torch.float64}
    for dtype, flat in weights.flat.items():
        assert flat.dtype == dtype and flat.dim() == 1
        assert torch.equal(
            flat,
            torch.cat(
                [
                    served[n].reshape(-1)
                    for n, d in zip(info["names"], info["dtype_names"])
                    if getattr(torch, d) == dtype
                ]
            ),
        )


def test_ipc_sync_gathers_before_the_first_pause_into_one_buffer_and_sends_one_handle(monkeypatch, servers):
    asked = fake_ipc(monkeypatch)
    gathers = record_gathers(monkeypatch)
    a, b = servers(), servers()
    sync = VllmWeightTransferSync([a.url, b.url], "ipc", api_key="test-token")
    policy = TiedPolicy()
    buffers = []
    for version in (1, 2, 3):
        policy.perturb(version)
        a.requests.clear(), b.requests.clear()
        stats = sync.sync(policy, version, rank=0)
        assert sync.weights is not None
        buffers.append((sync.weights.buffer.data_ptr(), sync.weights.buffer.untyped_storage().data_ptr()))
        for server in (a, b):
            assert paths(server)[-7:] == [
                "/pause",
                "/start_weight_update",
                "/update_weights",
                *CLEANUP,
                "/grpo/stale",
            ]
            assert gathers[-1] < min(arrival(server, "/pause")), "the gather ends before any replica is paused"
            info = server.body("/update_weights")["update_info"]
            assert info["packed"] is True and set(info) == {
                "names",
                "dtype_names",
                "shapes",
                "tensor_sizes",
                "packed",
                "ipc_handles_pickled",
            }
            handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
            assert handles == {"GPU-test-uuid": ("ipc", buffers[-1][0], sum(info["tensor_sizes"]))}  # one handle
            served = vllm_unpack(sync.weights.buffer, info)  # what the server reads through the handle
            for key, tensor in policy.state_dict().items():
                name = key.removeprefix("lm.").replace("lm_head.weight", "embed_tokens.weight")
                assert torch.equal(served[name], tensor), (version, key)
        assert stats["perf/weight_sync_pause_s"] >= max(stats["perf/weight_sync_update_s"], 0.0)
        assert stats["weight_sync/failed_replica_count"] == 0
    assert len(gathers) == 3 and len(set(buffers)) == 1, "one buffer, allocated on the first sync, reused"
    assert len(asked) == 1, "the CUDA IPC handle is made once, for the persistent buffer"


def test_nccl_sync_broadcasts_the_packed_buffer_once_per_replica(monkeypatch, servers):
    sent: list = []
    groups = itertools.count(1)
    gathers = record_gathers(monkeypatch)

    class NcclEngine:  # vLLM 0.25.1: trainer_send_weights(iterator, {"group": ...}) broadcasts each tensor
        @staticmethod
        def trainer_send_weights(iterator, args):
            sent.extend(
                (name, tensor.data_ptr(), tensor.numel(), args["group"], next(ARRIVALS)) for name, tensor in iterator
            )

    stub = {
        "vllm.distributed.weight_transfer.nccl_common": {"trainer_init": lambda info: f"group-{next(groups)}"},
        "vllm.distributed.weight_transfer.nccl_engine": {"NCCLWeightTransferEngine": NcclEngine},
    }
    for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    for name, attrs in stub.items():
        module = types.ModuleType(name)
        for key, value in attrs.items():
            setattr(module, key, value)
        monkeypatch.setitem(sys.modules, name, module)
    a, b = servers(), servers()
    sync = VllmWeightTransferSync([a.url, b.url], "nccl", api_key="test-token")
    policy = TiedPolicy()
    for version in (1, 2):
        sync.sync(policy, version, rank=0)
    assert sync.weights is not None
    size = sync.weights.buffer.numel()
    ptr = sync.weights.buffer.data_ptr()
    assert sorted(s[:4] for s in sent) == sorted(
        (vllm_sync.PACKED_NAME, ptr, size, g) for g in ("group-1", "group-2") for _ in (1, 2)
    ), "one broadcast of the whole buffer per replica and sync"
    for server in (a, b):
        info = server.body("/update_weights")["update_info"]
        # NCCLWeightTransferUpdateInfo's fields: a consumer told this buffer size takes the buffer in one broadcast
        assert info == {
            "names": [n for n, _ in sync.weights.views()],
            "dtype_names": [str(v.dtype).removeprefix("torch.") for _, v in sync.weights.views()],
            "shapes": [list(v.shape) for _, v in sync.weights.views()],
            "packed": True,
            "packed_buffer_size_bytes": size,
        }
        pauses = arrival(server, "/pause")
        assert gathers[0] < pauses[0] < gathers[1] < pauses[1], "each sync gathers before it pauses a replica"


def test_a_replica_resumes_without_waiting_for_another_replicas_update(monkeypatch, servers):
    """One round trip per replica: the slow replica's update is still running when the other one is resumed (the
    slow one waits for that resume; were the phases joined, it would wait out its deadline instead)."""
    fake_ipc(monkeypatch)
    slow, quick = servers(), servers()
    saw_resume: list[bool] = []

    def wait_for_quick_resume() -> None:
        deadline = time.monotonic() + 30
        while "/resume" not in paths(quick) and time.monotonic() < deadline:
            time.sleep(0.01)
        saw_resume.append("/resume" in paths(quick))

    slow.script(UPDATE_WEIGHTS_PATH, before=lambda _request: wait_for_quick_resume())
    sync = VllmWeightTransferSync([slow.url, quick.url], "ipc", api_key="test-token")
    sync.sync(TiedPolicy(), 1, rank=0)
    assert saw_resume == [True]
    assert max(arrival(quick, "/resume")) < min(arrival(slow, "/finish_weight_update"))
    # still all or nothing: both were paused and started before either update
    starts = arrival(slow, "/start_weight_update") + arrival(quick, "/start_weight_update")
    assert max(starts) < min(arrival(slow, "/update_weights") + arrival(quick, "/update_weights"))


def test_a_failed_gather_raises_before_any_pause(monkeypatch, servers):
    fake_ipc(monkeypatch)
    server = servers()
    sync = VllmWeightTransferSync([server.url], "ipc", api_key="test-token")

    def boom(self, policy) -> None:
        raise RuntimeError("out of memory in full_tensor")

    with monkeypatch.context() as patch:
        patch.setattr(PackedWeights, "gather", boom)
        with pytest.raises(RuntimeError, match="out of memory in full_tensor"):
            sync.sync(TiedPolicy(), 1, rank=0)
    assert paths(server) == ["/init_weight_transfer_engine"], "nothing paused, so nothing resumed"

    policy = TiedPolicy()
    sync.sync(policy, 1, rank=0)  # the next sync works
    assert paths(server)[-7:-4] == ["/pause", "/start_weight_update", "/update_weights"]
    server.requests.clear()
    policy.lm.extra = torch.nn.Linear(2, 2)  # the layout the buffer was made for no longer holds
    with pytest.raises(ServingError, match="parameters changed since the first sync"):
        sync.sync(policy, 2, rank=0)
    assert server.posts() == []


def test_under_nccl_a_rank_other_than_0_keeps_no_buffer_and_talks_to_no_server(servers):
    server = servers()
    sync = VllmWeightTransferSync([server.url], "nccl", api_key="test-token")
    assert sync.sync(TiedPolicy(), 1, rank=1) == {}
    assert sync.weights is None and server.posts() == []  # rank 0 alone broadcasts: its buffer is the only one


RANK_SCRIPT = """
import sys, torch, torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from grpo_core.train.weight_sync import vllm as vllm_sync
from grpo_core.train.weight_sync.sync_buffer import PackedWeights

rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
torch.manual_seed(0)
policy = torch.nn.Module()
policy.lm = lm = torch.nn.Module()
lm.embed_tokens = torch.nn.Embedding(7, 3).to(torch.bfloat16)
lm.q_proj = torch.nn.Linear(3, 5).to(torch.bfloat16)
lm.lm_head = torch.nn.Linear(3, 7, bias=False).to(torch.bfloat16)
lm.lm_head.weight = lm.embed_tokens.weight
lm.norm = torch.nn.LayerNorm(3)
lm.extra = torch.nn.Linear(3, 1, dtype=torch.float64)
for part in (lm.norm, lm.extra):  # FSDP2 gathers one dtype per group
    fully_shard(part)
fully_shard(policy)
assert type(policy.lm.q_proj.weight).__name__ == "DTensor"  # the gather is FSDP2's collective
full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True))
weights = PackedWeights.for_policy(policy, lambda name: name.removeprefix("lm."))
weights.gather(policy)
info = weights.update_fields()
pieces = weights.buffer.split(info["tensor_sizes"])
served = {n: p.view(getattr(torch, d)).view(*s) for n, d, s, p in
          zip(info["names"], info["dtype_names"], info["shapes"], pieces)}
for key, tensor in full.items():
    name = key.removeprefix("lm.").replace("lm_head.weight", "embed_tokens.weight")
    assert torch.equal(served[name], tensor), key
print("BIT-EXACT", len(full), flush=True)

vllm_sync.cuda_ipc_handle = lambda buffer: {f"GPU-{rank}": ("handle", buffer.numel())}
sync = vllm_sync.VllmWeightTransferSync(["http://127.0.0.1:9"], "ipc", api_key="test-token")
sync.initialised = True  # no server: any pause would fail on the refused connection instead
if rank == 1:  # its copy of the second parameter fails mid-gather (after that parameter's all-gather)
    original = PackedWeights.gather
    def failing(self, policy):
        self._views[self._order[1]] = torch.empty(0, dtype=torch.bfloat16)
        original(self, policy)
    PackedWeights.gather = failing
try:
    sync.sync(policy, 1, rank)
except Exception as exc:
    print("RAISED", type(exc).__name__, exc, flush=True)
dist.destroy_process_group()
"""


def test_two_fsdp2_ranks_gather_bit_exactly_and_a_failure_on_one_raises_on_both_before_any_pause(tmp_path):
    """Two gloo ranks with FSDP2 (DTensor parameters): each rank's buffer, read as vLLM unpacks it, equals the full
    state dict bit for bit (bf16, fp32 and fp64 groups, tied embedding); a copy failing on rank 1 in the middle of the
    gather fails the sync on both ranks without a collective out of step, and rank 0 pauses nothing (its only server
    does not exist: a pause would have raised a ControlFanOutError naming it)."""
    import os
    import subprocess

    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(tmp_path / "store")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for out in outs:
        assert "BIT-EXACT 8" in out, out  # embed, lm_head (tied), q_proj, norm and extra weight + bias
    assert (
        "RAISED ServingError weight sync: rank 1 failed before the pause (ServingError: weight sync: parameter"
        in outs[0]
    )
    assert "RAISED ServingError weight sync: parameter lm.q_proj.weight is torch.bfloat16 (5, 3) now" in outs[1]
    assert "ControlFanOutError" not in outs[0] and "127.0.0.1:9" not in outs[0]
