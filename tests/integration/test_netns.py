"""A multi-host run across Linux network namespaces (issue 13, step 3).

The test makes four network namespaces: a hub holding a bridge, and one per host — ``srv`` (the embedded
server on its loopback behind the router, which checks the run's bearer token, on 10.213.0.1),
``ro`` (the rollout process, Flight on 10.213.0.2) and ``tr`` (torchrun, 10.213.0.3) — each linked to
the bridge by a veth pair. The root namespace cannot reach 10.213.0.0/24 hosts (checked), so every byte
between the processes crosses the veth links. LoRA adapters travel through ``train.adapter_store`` (a folder
standing in for a mount all hosts share). Skipped, with the reason, where namespaces cannot be made
(not root, no ``ip``, no CAP_NET_ADMIN).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from grpo_core.security.auth import TOKEN_ENV
from grpo_core.serving.guard import ADAPTER_DIR_ENV

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "netns-run-token"  # the run's token (GRPO_RUN_TOKEN) and the servers' key (GRPO_SERVER_API_KEY) alike
SUBNET = "10.213.0"
CLONE_NEWNET = 0x40000000


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def hosts():
    """Namespaces ``{"srv": ns, "ro": ns, "tr": ns}`` on one bridge; removed afterwards (veths go with them)."""
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip` to create network namespaces")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root (CAP_NET_ADMIN)")
    tag = f"g13-{os.getpid()}"
    names = {role: f"{tag}-{role}" for role in ("hub", "srv", "ro", "tr")}
    made = []
    try:
        for ns in names.values():
            _ip("netns", "add", ns)
            made.append(ns)
    except subprocess.CalledProcessError as exc:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.decode().strip()}")
    try:
        hub = names["hub"]
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i, role in enumerate(("srv", "ro", "tr"), start=1):
            ns = names[role]
            _ip("-n", hub, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", hub, "link", "set", f"v{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{i}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield {role: names[role] for role in ("srv", "ro", "tr")}
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def in_namespace(ns: str, fn):
    """``fn()`` from inside network namespace ``ns`` (a thread that ``setns``-ed into it; this process stays)."""
    out: dict = {}

    def body() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        with open(f"/var/run/netns/{ns}") as f:
            if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
                out["error"] = OSError(ctypes.get_errno(), "setns failed")
                return
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _spawn(ns: str, argv: list[str], log: Path, **env: str) -> subprocess.Popen:
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "support")]),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        TOKEN_ENV: TOKEN,
        **env,
    }
    with open(log, "wb") as out:
        return subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv],
            cwd=ROOT,
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _wait(ns: str, url: str, process: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    def healthy() -> bool:
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    deadline = time.monotonic() + timeout_s
    while not in_namespace(ns, healthy):
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


def _reaches_router(url: str) -> bool:
    """Whether this namespace gets the router's model list (another host on the default route may answer)."""
    try:
        answer = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=3)
        return "tiny-qwen3" in answer.text
    except httpx.HTTPError:
        return False


def _config(tmp: Path) -> dict:
    return {
        "model": {"name": "tiny-qwen3"},
        "server": {"max_model_len": 256, "control_retry_s": 0.2, "control_timeout_s": 60},
        "rollout": {
            "dataset": "reasoning_gym:basic_arithmetic",
            "dataset_size": 64,
            "num_generations": 4,
            "max_completion_length": 16,
            "num_sampler_logprobs": 2,
            "max_staleness": 1,
            "first_step_tokens": 512,
            "reward_functions": ["rollout_helpers:parity_reward"],
            "flight_host": f"{SUBNET}.2",
            "rollout_worker_timeout_s": 120,
        },
        "packing": {"token_budget": 256},
        "train": {
            "output_dir": str(tmp / "out"),
            "device": "cpu",
            "num_ranks": 1,
            "max_steps": 2,
            "save_steps": 100,
            "weight_sync_steps": 1,
            "learning_rate": 1e-3,
            "adapter_store": str(tmp / "shared-store"),
            "lora": {"enabled": True, "r": 8, "alpha": 16},
        },
        "tracking": {"enabled": False},
    }


@pytest.mark.slow  # network namespaces: four hosts, a whole run across them
@pytest.mark.timeout(1200)
def test_run_across_namespaces_with_a_bearer_token(hosts, tmp_path):
    cfg = _config(tmp_path)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    router_url = f"http://{SUBNET}.1:8100"
    py = sys.executable
    procs: list[subprocess.Popen] = []
    try:
        server = _spawn(
            hosts["srv"],
            [
                py,
                "-m",
                "grpo_core.serving.embedded",
                "--model",
                "tiny-qwen3",
                "--port",
                "8000",
                "--max-model-len",
                "256",
                "--max-lora-rank",
                "8",
                "--num-threads",
                "1",
                "--generation-config",
                "vllm",
            ],
            tmp_path / "server.log",
            **{ADAPTER_DIR_ENV: str(tmp_path / "shared-store")},
        )  # its guard loads adapters from there
        procs.append(server)
        router = _spawn(
            hosts["srv"],
            [
                py,
                "-m",
                "grpo_core.serving.router",
                "--host",
                f"{SUBNET}.1",
                "--port",
                "8100",
                "--url",
                "http://127.0.0.1:8000",
                "--control-retry-s",
                "0.2",
            ],
            tmp_path / "router.log",
            GRPO_SERVER_API_KEY=TOKEN,
        )
        procs.append(router)
        _wait(hosts["ro"], router_url + "/health", router, tmp_path / "router.log")
        assert not _reaches_router(router_url), "the root namespace must not reach the hosts: traffic crosses the veths"

        location = tmp_path / "rollout.location"
        rollout = _spawn(
            hosts["ro"],
            [
                py,
                "-m",
                "grpo_core.rollout",
                "--config",
                str(tmp_path / "run.yaml"),
                "--server-url",
                router_url,
                "--location-file",
                str(location),
            ],
            tmp_path / "rollout.log",
            GRPO_SERVER_API_KEY=TOKEN,
        )
        procs.append(rollout)
        deadline = time.monotonic() + 300
        while not (location.is_file() and location.read_text()):
            assert rollout.poll() is None and time.monotonic() < deadline, (tmp_path / "rollout.log").read_text()[
                -3000:
            ]
            time.sleep(0.2)
        assert location.read_text().startswith(f"grpc://{SUBNET}.2:")
        cfg["train"]["rollout_location"] = location.read_text()
        (tmp_path / "train.yaml").write_text(yaml.safe_dump(cfg))
        trainer = _spawn(
            hosts["tr"],
            [
                py,
                "-m",
                "grpo_core.train.launch",
                "--nproc-per-node",
                "1",
                "-m",
                "grpo_core.train",
                "--config",
                str(tmp_path / "train.yaml"),
                "--server-url",
                router_url,
            ],
            tmp_path / "trainer.log",
            GRPO_SERVER_API_KEY=TOKEN,
        )
        procs.append(trainer)
        assert trainer.wait(600) == 0, (tmp_path / "trainer.log").read_text()[-4000:]
        assert rollout.wait(120) == 0, (tmp_path / "rollout.log").read_text()[-3000:]

        def served() -> tuple[int, list[str], str]:
            denied = httpx.get(router_url + "/v1/models", timeout=10).status_code
            auth = {"Authorization": f"Bearer {TOKEN}"}
            names = [m["id"] for m in httpx.get(router_url + "/v1/models", headers=auth, timeout=10).json()["data"]]
            return denied, names, httpx.get(router_url + "/metrics", headers=auth, timeout=10).text

        denied, names, metrics = in_namespace(hosts["tr"], served)
    finally:
        for process in procs:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
    steps = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [s["step"] for s in steps if "step" in s][-1] == 2
    assert denied == 401 and "policy-v2" in names, "the adapter went through the store and the authenticated router"
    assert sorted(p.name for p in (tmp_path / "shared-store").iterdir())[-1] == "policy-v2"
    hits = next(line for line in metrics.splitlines() if 'outcome="hit"' in line)
    assert float(hits.split()[-1]) > 0
    for process in procs:
        with pytest.raises(ProcessLookupError):
            os.kill(process.pid, 0)
