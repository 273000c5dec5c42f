"""How long the vLLM full-weight sync pauses generation, before and after gathering ahead of the pause (issue 25,
item 5). CPU micro-benchmark: a printed table, not a test.

``--ranks`` processes (gloo) shard a toy policy with FSDP2 (bf16 linear layers and fp32 norms, ``--hidden`` x
``--layers``), so gathering the full weights is the real collective (``DTensor.full_tensor``). Rank 0 syncs them to
``--engines`` simulated vLLM engines (:mod:`grpo_core.serving.simulated`, each holding ``/update_weights`` for
``--update-s``) over the real HTTP sequence, ``--syncs`` times per variant:

* ``before``: the sync as of ``--before`` (git commit; default the last one that paused first): every replica paused,
  then the full tensors gathered and sent, then finished and resumed;
* ``after``: this checkout's sync: gathered into the persistent packed buffer first, then paused around the copy.

Paused seconds are the engines' own accounting (``/sim/stats`` ``paused_s``, the mean over engines, per sync), not
the trainer's. There is no GPU: the CUDA IPC handle is a stand-in, and the ``before`` variant's vLLM trainer-side send
is a stand-in that walks the tensors, makes one handle per parameter and exchanges them across ranks as vLLM 0.25.1's
``IPCWeightTransferEngine.trainer_send_weights`` does. The GPU figures come from ``scripts/gpu_main_job.sh sync``.

    .venv/bin/python benchmarks/weight_sync_pause.py --ranks 2 --hidden 1024 --layers 8
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "6af2cb7"  # the last commit whose vLLM sync paused every replica before gathering


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="trainer ranks (gloo processes, FSDP2), default 2")
    p.add_argument("--hidden", type=int, default=1024, help="toy policy width (default 1024)")
    p.add_argument("--layers", type=int, default=8, help="toy policy depth (default 8)")
    p.add_argument("--engines", type=int, default=2, help="simulated engines (default 2)")
    p.add_argument("--update-s", type=float, default=0.02, help="seconds an engine holds /update_weights")
    p.add_argument("--syncs", type=int, default=3, help="syncs per variant (the first sets up; median of the rest)")
    p.add_argument("--before", default=BEFORE, help=f"git commit of the 'before' sync (default {BEFORE})")
    p.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = p.parse_args(argv)
    if args.ranks < 1 or args.engines < 1 or args.syncs < 2:
        p.error("--ranks and --engines must be >= 1 and --syncs >= 2")
    return args


def load_before(commit: str) -> types.ModuleType:
    """The vLLM sync module as of ``commit`` (``git show``), imported under its own name."""
    source = subprocess.run(
        ["git", "show", f"{commit}:grpo_core/train/weight_sync/vllm.py"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"weight_sync_vllm_{commit}.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("grpo_core.train.weight_sync._vllm_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stub_ipc_engine() -> None:
    """vLLM 0.25.1's unpacked IPC send, without CUDA: walk the tensors (the gather), one handle per parameter,
    ``all_gather_object`` of the handles, rank 0 calls the send callable, barrier."""
    import torch

    class IPCWeightTransferEngine:
        @staticmethod
        def trainer_send_weights(iterator, args) -> None:
            handles, names, refs = [], [], []
            for name, tensor in iterator:
                weight = tensor.detach().contiguous()
                refs.append(weight)
                names.append(name)
                handles.append({"GPU-stand-in": ("handle", weight.data_ptr(), weight.numel())})
            if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
                every: list = [None] * torch.distributed.get_world_size()
                torch.distributed.all_gather_object(every, handles)
                torch.distributed.barrier()
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                info = types.SimpleNamespace(
                    names=names,
                    dtype_names=[str(t.dtype).removeprefix("torch.") for t in refs],
                    shapes=[list(t.shape) for t in refs],
                    ipc_handles=handles,
                    packed=False,
                )
                args["send_mode"](info)
            if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
                torch.distributed.barrier()

    for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        sys.modules.setdefault(name, types.ModuleType(name))
    module = types.ModuleType("vllm.distributed.weight_transfer.ipc_engine")
    module.IPCWeightTransferEngine = IPCWeightTransferEngine  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module


def toy_policy(hidden: int, layers: int):
    """``layers`` blocks of a bf16 linear layer and an fp32 LayerNorm, under the trainer's ``lm.`` prefix."""
    import torch

    torch.manual_seed(0)
    policy = torch.nn.Module()
    policy.lm = torch.nn.Module()
    policy.lm.layers = torch.nn.ModuleList()
    for _ in range(layers):
        block = torch.nn.Module()
        block.proj = torch.nn.Linear(hidden, 4 * hidden, bias=False).to(torch.bfloat16)
        block.norm = torch.nn.LayerNorm(4 * hidden)
        policy.lm.layers.append(block)
    return policy


def worker(rank: int, args: argparse.Namespace, port: int, results: str) -> None:
    """One trainer rank: shard, then run both variants' syncs; rank 0 hosts the engines and writes the rows."""
    import httpx
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=args.ranks)
    mesh = init_device_mesh("cpu", (args.ranks,))
    policy = toy_policy(args.hidden, args.layers)
    for block in policy.lm.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    stub_ipc_engine()
    from grpo_core.train.weight_sync import vllm as after

    after.cuda_ipc_handle = lambda buffer: {"GPU-stand-in": ("handle", buffer.data_ptr(), buffer.numel())}
    before = load_before(args.before)
    sim, urls = None, [None]
    if rank == 0:
        sim, urls = start_engines(args)
    torch.distributed.broadcast_object_list(urls)
    rows = []
    for label, module in (("before", before), ("after", after)):
        sync = module.VllmWeightTransferSync(urls[0], "ipc", api_key="benchmark-token")
        per_sync = []
        for version in range(1, args.syncs + 1):
            paused0 = engines_paused_s(urls[0]) if rank == 0 else 0.0
            stats = sync.sync(policy, version, rank)
            if rank == 0:
                per_sync.append({**stats, "engine_paused_s": engines_paused_s(urls[0]) - paused0})
        if rank == 0:
            rows.append(summary(label, per_sync[1:]))
    if rank == 0:
        params = sum(p.numel() for p in policy.parameters())
        Path(results).write_text(json.dumps({"params": params, "rows": rows}))
        assert sim is not None
        sim.stop()
    httpx.Client().close()
    torch.distributed.destroy_process_group()


def start_engines(args: argparse.Namespace):
    """``--engines`` simulated engines in this process, idle, holding ``/update_weights`` for ``--update-s``."""
    from grpo_core.serving.simulated.__main__ import build
    from grpo_core.serving.simulated.__main__ import parse_args as sim_args
    from grpo_core.serving.simulated.server import SimulatedServers

    cost, settings = build(sim_args([f"--engines={args.engines}", f"--update-s={args.update_s}"]))
    sim = SimulatedServers(args.engines, cost, settings).start()
    return sim, [list(sim.urls)]


def engines_paused_s(urls: list[str]) -> float:
    """The engines' mean cumulative paused seconds (their own clocks)."""
    import httpx

    return sum(float(httpx.get(u + "/sim/stats", timeout=30).json()["paused_s"]) for u in urls) / len(urls)


def summary(label: str, syncs: list[dict]) -> dict:
    """Medians of the syncs after the first (which sets up)."""

    def median(key: str) -> float | None:
        values = sorted(s[key] for s in syncs if key in s)
        return values[len(values) // 2] if values else None

    keys = ("engine_paused_s", "perf/weight_sync_transfer_s", "perf/weight_sync_gather_s", "perf/weight_sync_pause_s")
    return {"variant": label, "syncs": len(syncs), **{k: median(k) for k in keys}}


def main() -> None:
    """CLI."""
    import tempfile

    import torch.multiprocessing as mp

    from grpo_core.run.children import free_port

    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = str(Path(tmp) / "rows.json")
        mp.spawn(worker, args=(args, free_port(), results), nprocs=args.ranks, join=True)
        out = json.loads(Path(results).read_text())
    print(
        f"vLLM full-weight sync, CPU: {args.ranks} gloo rank(s), FSDP2 toy policy {out['params'] / 1e6:.1f}M "
        f"parameters, {args.engines} simulated engine(s) holding /update_weights {args.update_s} s; "
        f"median of {args.syncs - 1} syncs after the first"
    )
    header = "| variant | engine paused s (engines' clock) | sync s | gather s (not paused) | pause s (trainer) |"
    print(header + "\n|---|---|---|---|---|")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731 - a table cell
    for r in out["rows"]:
        print(
            f"| {r['variant']} | {fmt(r['engine_paused_s'])} | {fmt(r['perf/weight_sync_transfer_s'])} | "
            f"{fmt(r['perf/weight_sync_gather_s'])} | {fmt(r['perf/weight_sync_pause_s'])} |"
        )
    if args.json:
        print(json.dumps({"args": vars(args), **out}))


if __name__ == "__main__":
    main()
