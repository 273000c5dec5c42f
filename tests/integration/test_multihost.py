"""Across hosts (issue 13, step 3): bearer token config, adapter store, multi-node torchrun command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_core.config import SERVER_API_KEY_ENV, RunConfig, load_config
from grpo_core.errors import ConfigError
from grpo_core.run.commands import local_trainer_command, trainer_command
from grpo_core.train.weight_sync.adapter_store import AdapterStore


def test_api_key_never_written_out_and_read_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(SERVER_API_KEY_ENV, raising=False)
    cfg = RunConfig(server={"api_key": "s3cr3t-token", "urls": ["http://gpu-1:8000/", "https://gpu-2:8443"]})
    assert cfg.server.resolved_api_key() == "s3cr3t-token"
    assert cfg.server.urls == ["http://gpu-1:8000", "https://gpu-2:8443"]
    written = tmp_path / "run_config.json"
    written.write_text(cfg.model_dump_json(indent=1))
    assert "s3cr3t-token" not in written.read_text()
    assert "s3cr3t-token" not in json.dumps(cfg.model_dump(mode="json")) and "s3cr3t-token" not in repr(cfg)
    with pytest.raises(ConfigError, match="server.api_key holds a redacted value"):
        load_config(written)  # the mask is not a key
    again = load_config(written, secrets={"server.api_key": "s3cr3t-token"})  # what the flow's processes get
    assert again.server.resolved_api_key() == "s3cr3t-token"
    monkeypatch.setenv(SERVER_API_KEY_ENV, "from-env")
    assert RunConfig().server.resolved_api_key() == "from-env", "a process started by hand: the environment"


@pytest.mark.parametrize("url", ["gpu-1:8000", "ftp://gpu-1", "http://"])
def test_bad_server_url_names_the_field(url):
    with pytest.raises(ConfigError, match=r"server.urls.*http\(s\) base URL"):
        load_config(overrides=[f"server.urls=['{url}']"])


@pytest.mark.parametrize(
    "urls, says",
    [
        (
            ["http://gpu-1:8000", "http://gpu-1:8000/"],
            "server.urls lists one server twice ('http://gpu-1:8000' and 'http://gpu-1:8000/')",
        ),
        (
            ["http://gpu-1", "HTTP://GPU-1:80"],
            "server.urls lists one server twice ('http://gpu-1' and 'HTTP://GPU-1:80')",
        ),
        (["https://gpu-1:443/", "https://gpu-1"], "server.urls lists one server twice"),
        (
            ["http://gpu-1:8000/v1"],
            "server.urls: 'http://gpu-1:8000/v1' ends in /v1, which the client adds to every "
            "request; write the server's base URL 'http://gpu-1:8000'",
        ),
        (
            ["http://gpu-1:8000/v1/"],
            "server.urls: 'http://gpu-1:8000/v1/' ends in /v1, which the client adds to every "
            "request; write the server's base URL 'http://gpu-1:8000'",
        ),
        (["http://gpu-1:99999"], "server.urls: 'http://gpu-1:99999' is not an http(s) base URL"),
        (["http://gpu-1:8000?key=1"], "server.urls: 'http://gpu-1:8000?key=1' is not an http(s) base URL"),
    ],
)
def test_a_replica_listed_twice_or_an_openai_base_url_is_refused_naming_the_fix(urls, says):
    """One server under two spellings would get every control call twice (an adapter loaded twice, a pause counted
    twice) and half the groups as if it were two replicas; ``/v1`` doubles in every request path (404)."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"server.urls={urls!r}"])
    assert str(info.value).splitlines()[1].strip().startswith(says), str(info.value)
    distinct = ["http://gpu-1:8000/", "http://gpu-1:8001", "https://gpu-1:8000", "http://gpu-2:8000/proxy/"]
    assert RunConfig(server={"urls": distinct}).server.urls == [
        "http://gpu-1:8000",
        "http://gpu-1:8001",
        "https://gpu-1:8000",
        "http://gpu-2:8000/proxy",
    ]


def test_a_server_key_left_in_the_shell_is_what_the_runs_own_replicas_check(tmp_path, monkeypatch):
    """``GRPO_SERVER_API_KEY`` (or ``server.api_key``) is what every client of the run sends, so the replicas the run
    starts itself check it instead of the run's token (before: every request 401, the run failed)."""
    import httpx
    from serving_helpers import embedded_server

    from grpo_core.security.auth import bearer_headers, ensure_run_token

    run = ensure_run_token()
    monkeypatch.setenv(SERVER_API_KEY_ENV, "left-from-a-multihost-run")
    key = RunConfig().server.resolved_api_key()
    assert key == "left-from-a-multihost-run" != run
    with embedded_server(tmp_path) as server:
        ok = httpx.get(f"{server.url}/v1/models", headers=bearer_headers(key), timeout=30)
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny-qwen3"
        assert httpx.get(f"{server.url}/v1/models", headers=bearer_headers(run), timeout=30).status_code == 401


def test_several_trainer_hosts_need_a_rendezvous_endpoint():
    with pytest.raises(ConfigError, match="train.rdzv_endpoint"):
        load_config(overrides=["train.nnodes=2"])


@pytest.mark.parametrize(
    "endpoint", ["trainer-0", "http://trainer-0:29400", "trainer-0:0", "trainer-0:70000", "trainer-0:", ":29400"]
)
def test_a_rendezvous_endpoint_that_is_not_host_and_port_is_refused(endpoint):
    """torchrun got ``--master-addr`` / ``--master-port`` split from it (``'trainer-0'``: the port 'trainer-0')."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["train.nnodes=2", f"train.rdzv_endpoint='{endpoint}'"])
    assert str(info.value).splitlines()[1].strip() == (
        f"train.rdzv_endpoint: {endpoint!r} is not 'host:port' (no scheme, a port 1-65535); write e.g. "
        "'trainer-0:29400'"
    )
    for good in ("trainer-0:29400", "10.0.0.7:1", "[fd00::7]:29400"):
        assert load_config(overrides=["train.nnodes=2", f"train.rdzv_endpoint='{good}'"]).train.rdzv_endpoint == good


def test_trainer_command_per_host():
    one = trainer_command(RunConfig(train={"num_ranks": 2}), Path("c.json"), ["http://a:1"])
    assert one[1:3] == ["-m", "grpo_core.train.launch"] and "--nnodes" not in one  # stores on loopback
    assert one[3:] == [
        "--nproc-per-node",
        "2",
        "-m",
        "grpo_core.train",
        "--config",
        "c.json",
        "--server-url",
        "http://a:1",
    ]
    assert local_trainer_command("c.json", 2, ["http://a:1"]) == one  # the tests' and benchmarks' launch is the flow's
    cfg = RunConfig(train={"num_ranks": 4, "nnodes": 3, "rdzv_endpoint": "trainer-0:29400"})
    cmds = [trainer_command(cfg, Path("c.json"), ["http://a:1"], node_rank=r) for r in range(3)]
    for rank, cmd in enumerate(cmds):
        args = dict(zip(cmd[3::1], cmd[4::1]))
        assert cmd[1:3] == ["-m", "torch.distributed.run"]
        assert (args["--nnodes"], args["--node-rank"], args["--nproc-per-node"]) == ("3", str(rank), "4")
        assert (args["--master-addr"], args["--master-port"]) == ("trainer-0", "29400")
        assert args["--rdzv-conf"] == "timeout=900"  # train.rdzv_timeout_s: a host missing fails the wait then
        assert cmd[-2:] == ["--server-url", "http://a:1"]
    for outside in (-1, 3):  # a host beyond train.nnodes would wait at the rendezvous until torch's timeout
        with pytest.raises(ValueError, match=f"node_rank={outside} is not a trainer host of train.nnodes=3"):
            trainer_command(cfg, Path("c.json"), [], node_rank=outside)


@pytest.mark.slow  # multi-node: two torchrun nodes per case
@pytest.mark.parametrize(
    "node1", ["the run's token", "no token", "another token", "its own output folder", "another learning rate"]
)
def test_trainer_hosts_prove_the_run_token_before_anything_is_trained(node1, tmp_path):
    """Two trainer hosts (two torchrun nodes of one rank each, the commands ``trainer_command`` builds, joined at
    ``train.rdzv_endpoint``): with the run's token on both they train; a node with no token or another one stops
    both nodes before the first step (torchrun's rendezvous itself lets anyone in), each naming the cause; so does
    a node whose ``train.output_dir`` is not the folder rank 0 writes in (each rank writes its checkpoint shards
    there)."""
    import os
    import subprocess

    from trainer_helpers import ROOT, read_jsonl, trainer_config, write_samples

    from grpo_core.run.children import free_port
    from grpo_core.security.auth import TOKEN_ENV

    config = trainer_config(
        tmp_path,
        write_samples(tmp_path / "samples.arrow", 4),
        max_steps=2,
        save_steps=2,
        nnodes=2,
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        shared_folder_wait_s=1.0,  # node 1's own folder never shows rank 0's probe: a test-sized wait (default 30 s)
    )
    cfg = load_config(config)
    tokens = ["run-token-0123", {"no token": None, "another token": "someone-elses-token"}.get(node1, "run-token-0123")]
    own = {
        "its own output folder": ["--set", f"train.output_dir={tmp_path / 'node1-out'}"],
        "another learning rate": ["--set", "train.learning_rate=0.5", "--set", "train.gpu_ids=[3]"],
    }.get(node1, [])
    procs, logs = [], [tmp_path / f"node{n}.log" for n in (0, 1)]
    for node, (token, log) in enumerate(zip(tokens, logs)):
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **({TOKEN_ENV: token} if token else {})})
        with open(log, "w") as out:
            procs.append(
                subprocess.Popen(
                    trainer_command(cfg, config, [], node_rank=node) + (own if node else []),
                    cwd=ROOT,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    try:
        codes = [p.wait(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    text = [log.read_text() for log in logs]
    steps = read_jsonl(tmp_path / "out" / "metrics.jsonl") if (tmp_path / "out" / "metrics.jsonl").exists() else []
    if node1 == "the run's token":
        assert codes == [0, 0], text[0][-3000:] + text[1][-3000:]
        assert "every trainer rank proved it holds the run's token (2 ranks)" in text[0]
        assert [r["step"] for r in steps if "step" in r][-1] == 2
        return
    assert codes[0] != 0 and codes[1] != 0, text
    assert not any("step" in r for r in steps), "a step was trained with an unproven rank"
    if node1 == "another learning rate":  # named on both hosts; gpu_ids (each host's own) is not compared
        for text_of_node in text:
            assert "the trainer hosts train with different configs" in text_of_node
            assert "rank 1 (host " in text_of_node and "): train.learning_rate: 0.001 (rank 0) -> 0.5" in text_of_node
            assert "gpu_ids" not in text_of_node.split("different configs")[1][:400]
        return
    if node1 == "its own output folder":
        for text_of_node in text:
            assert "is not one folder shared by every trainer host: rank 1 (host " in text_of_node
        assert not list((tmp_path / "out").glob(".grpo-shared-*")), "rank 0's probe file was left behind"
        return
    assert "trainer rank 1 (host " in text[0] and f"did not prove it holds the run's token ({TOKEN_ENV}" in text[0]
    assert tokens[0] not in text[0] + text[1] and "someone-elses-token" not in text[0] + text[1]
    if node1 == "no token":
        assert f"{TOKEN_ENV} is not set on trainer host" in text[1] and "(rank 1)" in text[1]
    else:
        assert "rank 0 at train.rdzv_endpoint did not prove it holds this host's" in text[1]


def _adapter_folder(path: Path) -> dict[str, bytes]:
    path.mkdir(parents=True)
    files = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": bytes(range(256)) * 64}
    for name, data in files.items():
        (path / name).write_bytes(data)
    return files


def test_adapter_store_publishes_complete_versions(tmp_path):
    files = _adapter_folder(tmp_path / "local" / "policy-v1")
    store = AdapterStore(f"file://{tmp_path}/bucket/run", served_as="/mnt/adapters", timeout_s=5)
    served = store.publish(tmp_path / "local" / "policy-v1", "policy-v1")
    assert served == "/mnt/adapters/policy-v1"
    published = tmp_path / "bucket" / "run" / "policy-v1"
    assert {p.name: p.read_bytes() for p in published.iterdir()} == files
    assert sorted(p.name for p in (tmp_path / "bucket" / "run").iterdir()) == ["policy-v1"], "no partial left"
    store.remove("policy-v1")
    assert not published.exists()
    assert AdapterStore(None).publish(tmp_path / "local" / "policy-v1", "policy-v1") == str(
        tmp_path / "local" / "policy-v1"
    )


def test_several_trainer_hosts_need_the_run_token_from_the_environment(monkeypatch, tmp_path):
    from grpo_core.run import preflight
    from grpo_core.security.auth import TOKEN_ENV

    cfg = load_config(
        overrides=["train.nnodes=2", "train.rdzv_endpoint=trainer-0:29400", f"train.output_dir={tmp_path}"]
    )
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(
        ConfigError,
        match=f"train.nnodes=2 needs {TOKEN_ENV} in this environment .* same value on "
        "every trainer host; it is not set",
    ):
        preflight.check_run(cfg)
    assert list(tmp_path.iterdir()) == []  # refused before any folder was made
    monkeypatch.setenv(TOKEN_ENV, "short-token")
    with pytest.raises(ConfigError, match="it has 11 characters \\(fewer than 16\\)"):
        preflight.check_tokens(cfg)
    monkeypatch.setenv(TOKEN_ENV, "0123456789abcdef")
    preflight.check_tokens(cfg)  # passes
    monkeypatch.delenv(TOKEN_ENV)
    preflight.check_tokens(load_config(overrides=[f"train.output_dir={tmp_path}"]))  # one host: a drawn token


@pytest.mark.parametrize("name", ["GRPO_RUN_TOKEN", "GRPO_SERVER_API_KEY"])
@pytest.mark.parametrize(
    "value, says",
    [
        (" ", "it is empty or blank"),
        ("tök-secret", "it holds 1 character(s) an HTTP header"),
        ("two secret-words", "it holds 1 character(s) an HTTP header"),
    ],
)
def test_a_token_that_cannot_travel_in_a_header_is_refused_naming_its_variable(name, value, says, monkeypatch):
    from grpo_core.run import preflight

    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        preflight.check_tokens(load_config())
    assert str(info.value).startswith(f"{name} (environment): {says}") and "secret" not in str(info.value)


@pytest.mark.parametrize(
    "override, says",
    [
        ("server.api_key=''", "server.api_key: it is empty or blank"),
        ("server.api_key='a key'", "server.api_key: it holds 1 character(s) an HTTP header cannot carry"),
        (
            "server.urls=['http://user:hunter22@gpu-1:8000']",
            "server.urls: a URL of 'http://gpu-1:8000' carries a user name or password",
        ),
        ("train.adapter_store=''", "train.adapter_store is empty; unset it"),
        ("train.rdzv_endpoint=-x:29400", "train.rdzv_endpoint: '-x:29400' is not 'host:port'"),
    ],
)
def test_bad_remote_settings_are_refused_without_echoing_secrets(override, says):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert says in str(info.value) and "hunter22" not in str(info.value) and "a key" not in str(info.value)


def test_the_rendezvous_host_must_resolve_to_this_host(monkeypatch):
    """Names resolve through a table of the test's own (no DNS: the test stays on this host): this host's name to
    loopback, an unknown name to the resolver's error, and an address of nobody's (TEST-NET-1) to itself."""
    import socket

    from grpo_core.run.preflight import check_rendezvous_host

    table = {"127.0.0.1": "127.0.0.1", "trainer-0.this-host.test": "127.0.0.1", "192.0.2.7": "192.0.2.7"}
    asked = []

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        asked.append(host)
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (table[host], port or 0))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)

    def cfg(endpoint: str) -> RunConfig:
        return RunConfig(train={"nnodes": 2, "rdzv_endpoint": endpoint})

    check_rendezvous_host(cfg("127.0.0.1:29400"))
    check_rendezvous_host(cfg("trainer-0.this-host.test:29400"))  # this host by name
    with pytest.raises(ConfigError, match="'nosuchhost-zz.invalid' does not resolve on this host"):
        check_rendezvous_host(cfg("nosuchhost-zz.invalid:29400"))
    with pytest.raises(ConfigError, match=r"'192.0.2.7' \(192.0.2.7\) is not this host"):  # TEST-NET-1: nobody's
        check_rendezvous_host(cfg("192.0.2.7:29400"))
    assert asked == ["127.0.0.1", "trainer-0.this-host.test", "nosuchhost-zz.invalid", "192.0.2.7"]  # all ours
