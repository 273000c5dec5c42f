"""The NCCL weight-transfer request sequence against a recording HTTP server.

NCCL needs two GPUs (trainer and vLLM on different devices), which CI never has;
the IPC path ran against a real vLLM 0.25.1 on an H200 (benchmarks/vllm_weight_sync.py).
Here vLLM's two trainer-side NCCL calls are replaced by recorders, and the HTTP side
is a real server that logs what it receives, so the order of the protocol is checked.
"""

import json
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from grpo_core.train.vllm_sync import VllmWeightTransferSync


class Recorder(BaseHTTPRequestHandler):
    calls: list = []

    def _answer(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        self.calls.append(("GET", self.path, None))
        self._answer({"world_size": 1})

    def do_POST(self):  # noqa: N802
        n = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(n)) if n else None
        self.calls.append(("POST", self.path, body))
        self._answer({})

    def log_message(self, *args):
        pass


def stub_vllm(monkeypatch, sent):
    def trainer_init(info):
        sent.append(("trainer_init", info["world_size"]))
        return "group"

    class Engine:
        @staticmethod
        def trainer_send_weights(iterator, args):
            sent.extend(("broadcast", name, args["group"]) for name, _ in iterator)

    for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    common = types.ModuleType("vllm.distributed.weight_transfer.nccl_common")
    common.trainer_init = trainer_init
    engine = types.ModuleType("vllm.distributed.weight_transfer.nccl_engine")
    engine.NCCLWeightTransferEngine = Engine
    monkeypatch.setitem(sys.modules, common.__name__, common)
    monkeypatch.setitem(sys.modules, engine.__name__, engine)


def test_nccl_sync_follows_the_weight_transfer_protocol(monkeypatch):
    sent = []
    stub_vllm(monkeypatch, sent)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    policy = torch.nn.Module()
    policy.lm = torch.nn.Linear(3, 2).to(torch.bfloat16)
    sync = VllmWeightTransferSync([url], "nccl")
    for version in (1, 2):
        sync.sync(policy, version, rank=0)
    server.shutdown()
    paths = [(m, p) for m, p, _ in Recorder.calls]
    per_sync = [("POST", "/pause"), ("POST", "/start_weight_update"), ("POST", "/update_weights"),
                ("POST", "/finish_weight_update"), ("POST", "/reset_prefix_cache"), ("POST", "/resume")]
    assert paths == [("GET", "/get_world_size"), ("POST", "/init_weight_transfer_engine")] + per_sync + per_sync
    init = Recorder.calls[1][2]["init_info"]
    assert (init["rank_offset"], init["world_size"]) == (1, 2)
    update = next(b for m, p, b in Recorder.calls if p == "/update_weights")["update_info"]
    assert update == {"names": ["weight", "bias"], "dtype_names": ["bfloat16", "bfloat16"], "shapes": [[2, 3], [2]],
                      "packed": False}
    assert sent == [("trainer_init", 2)] + [("broadcast", n, "group") for n in ("weight", "bias")] * 2
