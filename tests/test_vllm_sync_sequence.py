"""vLLM full-weight sync (NCCL and IPC) against real recording HTTP servers: request bodies, failures, two servers.

NCCL needs two GPUs and IPC a CUDA device, which CI never has; both ran against a real vLLM
0.25.1 on an H200 (benchmarks/vllm_weight_sync.py, scripts/gpu_main_job.sh). Here vLLM's
trainer-side calls are replaced by stand-ins that behave as vLLM 0.25.1's source does
(``nccl_common.trainer_init``, ``NCCLWeightTransferEngine.trainer_send_weights``,
``IPCWeightTransferEngine.trainer_send_weights`` collecting one handle per parameter and calling
the send callable once), and each vLLM server is a real HTTP server that records every request
and can be told to fail one path. What is asserted comes from vLLM's API, not from this module:
pause in keep mode (vLLM aborts in-flight requests without it), the init info of the NCCL group,
the update bodies, and that every paused server is finished and resumed after a failure.
"""

from __future__ import annotations

import base64
import json
import pickle
import sys
import threading
import types
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
import torch

from grpo_core.errors import ServingError
from grpo_core.train.vllm_sync import VllmWeightTransferSync

CLEANUP = [("/finish_weight_update", {}), ("/reset_prefix_cache", {"reset_running_requests": ["true"]}),
           ("/resume", {})]


class RecordingServer:
    """A real HTTP server on a free port recording ``(method, path, query, body)``; ``fail`` maps path -> status."""

    def __init__(self, fail: dict[str, int] | None = None):
        self.calls: list[tuple[str, str, dict, object]] = []
        self.fail = fail or {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self, method: str) -> None:
                n = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                url = urlsplit(self.path)
                outer.calls.append((method, url.path, parse_qs(url.query), body))
                status = outer.fail.get(url.path, 200)
                self._answer(status, {"world_size": 1} if status == 200 else {"error": "boom on " + url.path})

            def do_GET(self):  # noqa: N802
                self._record("GET")

            def do_POST(self):  # noqa: N802
                self._record("POST")

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def paths(self) -> list[tuple[str, dict]]:
        return [(p, q) for m, p, q, _ in self.calls if m == "POST"]

    def body(self, path: str) -> object:
        return next(b for _, p, _, b in self.calls if p == path)

    def close(self) -> None:
        self.httpd.shutdown()


@dataclass
class UpdateInfo:
    """Shape of vLLM's ``IPCWeightTransferUpdateInfo`` (what the send callable receives)."""

    names: list
    dtype_names: list
    shapes: list
    ipc_handles: list
    packed: bool = False


def stub_vllm(monkeypatch, sent: list) -> None:
    """Install stand-ins for the vLLM trainer-side modules the sync imports."""
    def trainer_init(info):
        sent.append(("trainer_init", info["world_size"], info["rank_offset"]))
        return f"group-{len([s for s in sent if s[0] == 'trainer_init'])}"

    class NcclEngine:
        @staticmethod
        def trainer_send_weights(iterator, args):
            sent.extend(("broadcast", name, args["group"]) for name, _ in iterator)

    class IpcEngine:
        @staticmethod
        def trainer_send_weights(iterator, args):
            names, dtypes, shapes, handles = [], [], [], []
            for name, tensor in iterator:  # vLLM: one {GPU UUID: rebuild args} per parameter, then one send
                names.append(name)
                dtypes.append(str(tensor.dtype).split(".")[-1])
                shapes.append(list(tensor.shape))
                handles.append({"GPU-test-uuid": ("handle", name, tuple(tensor.shape))})
            sent.append(("ipc_send", tuple(names)))
            args["send_mode"](UpdateInfo(names, dtypes, shapes, handles))

    for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    modules = {"nccl_common": {"trainer_init": trainer_init}, "nccl_engine": {"NCCLWeightTransferEngine": NcclEngine},
               "ipc_engine": {"IPCWeightTransferEngine": IpcEngine}}
    for short, attrs in modules.items():
        module = types.ModuleType(f"vllm.distributed.weight_transfer.{short}")
        for key, value in attrs.items():
            setattr(module, key, value)
        monkeypatch.setitem(sys.modules, module.__name__, module)


def tiny_policy() -> torch.nn.Module:
    policy = torch.nn.Module()
    policy.lm = torch.nn.Module()
    policy.lm.attn = torch.nn.Module()
    policy.lm.attn.q_proj = torch.nn.Linear(3, 2).to(torch.bfloat16)
    return policy


def per_sync(update: bool = True) -> list[tuple[str, dict]]:
    steps = [("/pause", {"mode": ["keep"]}), ("/start_weight_update", {})]
    return steps + ([("/update_weights", {})] if update else []) + CLEANUP


@pytest.fixture
def servers():
    made: list[RecordingServer] = []

    def make(**kw) -> RecordingServer:
        made.append(RecordingServer(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_nccl_sync_bodies_on_two_servers(monkeypatch, servers):
    sent: list = []
    stub_vllm(monkeypatch, sent)
    a, b = servers(), servers()
    sync = VllmWeightTransferSync([a.url, b.url], "nccl")
    for version in (1, 2):
        assert "perf/weight_sync_transfer_s" in sync.sync(tiny_policy(), version, rank=0)
    for server in (a, b):
        assert [(m, p) for m, p, _, _ in server.calls][:2] == [("GET", "/get_world_size"),
                                                              ("POST", "/init_weight_transfer_engine")]
        assert server.paths()[1:] == per_sync() + per_sync()
        init = server.body("/init_weight_transfer_engine")["init_info"]
        assert init["master_address"] == "127.0.0.1" and init["rank_offset"] == 1 and init["world_size"] == 2
        assert 0 < init["master_port"] < 65536
        assert server.body("/start_weight_update") == {"is_checkpoint_format": True}
        assert server.body("/update_weights") == {"update_info": {
            "names": ["attn.q_proj.weight", "attn.q_proj.bias"], "dtype_names": ["bfloat16", "bfloat16"],
            "shapes": [[2, 3], [2]], "packed": False}}
    ports = {s.body("/init_weight_transfer_engine")["init_info"]["master_port"] for s in (a, b)}
    assert len(ports) == 2, "each server needs its own NCCL group"
    names = ("attn.q_proj.weight", "attn.q_proj.bias")
    assert sent == [("trainer_init", 2, 1), ("trainer_init", 2, 1)] + [
        ("broadcast", n, g) for _ in (1, 2) for g in ("group-1", "group-2") for n in names]


def test_ipc_sync_frames_the_handles_as_vllm_http_transport(monkeypatch, servers):
    sent: list = []
    stub_vllm(monkeypatch, sent)
    a, b = servers(), servers()
    sync = VllmWeightTransferSync([a.url, b.url], "ipc", lora_names=True)
    sync.sync(tiny_policy(), 1, rank=0)
    sync.sync(tiny_policy(), 2, rank=0)
    names = ["attn.q_proj.base_layer.weight", "attn.q_proj.base_layer.bias"]  # --enable-lora wraps the linear layers
    assert sent == [("ipc_send", tuple(names))] * 2, "one gather per sync serves every server"
    for server in (a, b):
        assert server.paths() == [("/init_weight_transfer_engine", {})] + per_sync() + per_sync()
        assert server.body("/init_weight_transfer_engine") == {"init_info": {}}
        info = server.body("/update_weights")["update_info"]
        assert set(info) == {"names", "dtype_names", "shapes", "packed", "ipc_handles_pickled"}
        assert (info["names"], info["dtype_names"], info["shapes"], info["packed"]) == (
            names, ["bfloat16", "bfloat16"], [[2, 3], [2]], False)
        handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
        assert handles == [{"GPU-test-uuid": ("handle", n, s)} for n, s in zip(names, [(2, 3), (2,)])]


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_update_weights_500_raises_and_every_server_is_finished_and_resumed(monkeypatch, servers, backend):
    stub_vllm(monkeypatch, [])
    good, bad = servers(), servers(fail={"/update_weights": 500})
    sync = VllmWeightTransferSync([bad.url, good.url], backend)
    with pytest.raises(ServingError, match=r"/update_weights answered 500"):
        sync.sync(tiny_policy(), 1, rank=0)
    assert bad.paths()[-len(per_sync()):] == per_sync()
    # NCCL stops at the failing server; IPC posts the same update to both and reports the failure.
    expected = per_sync(update=backend == "ipc")
    assert good.paths()[-len(expected):] == expected


def test_failed_pause_still_resumes_the_servers_already_paused(monkeypatch, servers):
    stub_vllm(monkeypatch, [])
    first, refusing = servers(), servers(fail={"/pause": 500})
    sync = VllmWeightTransferSync([first.url, refusing.url], "ipc")
    with pytest.raises(ServingError, match=r"/pause answered 500"):
        sync.sync(tiny_policy(), 1, rank=0)
    assert first.paths() == [("/init_weight_transfer_engine", {}), ("/pause", {"mode": ["keep"]}),
                             ("/start_weight_update", {})] + CLEANUP
    assert refusing.paths()[-4:] == [("/pause", {"mode": ["keep"]})] + CLEANUP
    assert not any(p == "/update_weights" for p, _ in first.paths() + refusing.paths())
