"""Entry point of the embedded vLLM-compatible server: ``python -m grpo_core.serving.embedded``.

Arguments are parsed and validated (into ``ModelConfig``/``ServerConfig``) before torch or
transformers are imported, so ``--help`` and config errors are instant. The server binds
its socket before loading the model only to learn the port (``--port 0`` picks a free
one, written to ``--port-file``); ``/health`` answers once the model is loaded.

Every other route needs ``Authorization: Bearer`` with the run's control key (``$GRPO_CONTROL_KEY``, or derived
from ``$GRPO_RUN_TOKEN``, which then passes too; from the environment only, the server refuses to start without
either), the generation routes take the inference key as well, and ``GET /grpo/run_nonce`` reports
``$GRPO_RUN_NONCE`` (``grpo_core.serving.guard``).

Example::

    GRPO_RUN_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe(32))') \
        python -m grpo_core.serving.embedded --model smollm2-135m-instruct --port 8000
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path

from grpo_core.config import VLLM_LORA_RANKS, ModelConfig, ServerConfig
from grpo_core.run.durable import atomic_write_text
from grpo_core.security.auth import CONTROL_KEY_ENV, ROLE_CONTROL, TOKEN_ENV, role_key

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (names follow ``vllm serve`` where one exists)."""
    p = argparse.ArgumentParser(
        prog="python -m grpo_core.serving.embedded",
        description="vLLM-compatible generation server on transformers (CPU or CUDA).",
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="registry name, local HF folder or Hub id")
    p.add_argument("--revision", default=None, help="Hub ids: branch, tag or commit (from the Hub cache)")
    p.add_argument("--served-model-name", default=None, help="name clients use in 'model' (default: --model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--cache-dir", type=Path, default=None, help="folder for converted models")
    p.add_argument("--model-seed", type=int, default=0, help="seed of tiny-* random models")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (loopback by default)")
    p.add_argument("--port", type=port_number, default=8000, help="port; 0 = a free port")
    p.add_argument("--port-file", type=Path, default=None, help="write the bound port here")
    p.add_argument("--device", default="auto", help="torch device; auto = cuda if available else cpu")
    p.add_argument("--num-threads", type=int, default=0, help="torch CPU threads; 0 = torch default")
    p.add_argument("--max-model-len", type=int, default=2048, help="prompt + completion tokens per request")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded per batch")
    p.add_argument(
        "--kv-cache-size-tokens", type=int, default=None, help="KV budget (default max-num-seqs*max-model-len)"
    )
    p.add_argument("--max-logprobs", type=int, default=20, help="most log-probs per token a request may ask for")
    p.add_argument("--max-loras", type=int, default=6, help="adapters expected to be resident (reported only)")
    p.add_argument("--max-lora-rank", type=int, default=64, choices=VLLM_LORA_RANKS, help="largest adapter rank")
    p.add_argument(
        "--generation-config",
        default="auto",
        help="defaults of sampling fields a request omits: 'auto' = the model's generation_config.json "
        "(vLLM's default), 'vllm' = neutral values, or a folder holding a generation_config.json",
    )
    p.add_argument(
        "--max-pause-s",
        type=float,
        default=300.0,
        help="seconds a /pause may last before the server resumes itself (0 = no limit)",
    )
    p.add_argument(
        "--adapter-dir",
        default=None,
        help="the only folder (or fsspec URL, train.adapter_store) LoRA adapters are loaded from "
        "(default: none, every load is refused)",
    )
    p.add_argument(
        "--weights-dir",
        type=Path,
        default=None,
        help="the only folder full weights are read from (default: none, every update is refused)",
    )
    p.add_argument("--ssl-certfile", default=None, help="PEM certificate: serve HTTPS (tls.cert_file)")
    p.add_argument("--ssl-keyfile", default=None, help="PEM key of --ssl-certfile (tls.key_file)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def port_number(text: str) -> int:
    """An argparse ``type`` for a TCP port: an integer in 0..65535 (0 = a free one).

    Raises:
        argparse.ArgumentTypeError: anything else (argparse prints it after the option's name and exits 2).
    """
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0..65535; 0 = a free one)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is outside 0..65535 (0 = a free one)")
    return port


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 when the host has a colon; port 0 = a free one), inheritable."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def listen(host: str, port: int) -> socket.socket:
    """:func:`bind_socket` for a command-line server (``--host``, ``--port``).

    Raises:
        SystemExit: the address cannot be bound (the port is taken, the host is not this machine's); the message
            names it and the fix.
    """
    try:
        return bind_socket(host, port)
    except OSError as exc:
        sys.exit(
            f"cannot listen on {host}:{port}: {exc.strerror or exc} (another process holds the port, or "
            "--host is not an address of this machine?); stop it, or choose another --port (0 = a free one)"
        )


def serve(args: argparse.Namespace, model_cfg: ModelConfig, server_cfg: ServerConfig) -> None:
    """Load the model, start the engine and run uvicorn on an already-bound socket.

    Raises:
        SystemExit: neither ``GRPO_CONTROL_KEY`` nor ``GRPO_RUN_TOKEN`` is set, the port is taken, or a TLS file
            cannot be used (the message says which and the fix).
    """
    if role_key(ROLE_CONTROL) is None:
        sys.exit(
            f"neither {CONTROL_KEY_ENV} nor {TOKEN_ENV} is set: the embedded server answers only requests carrying "
            f"a key of the run; set one in the environment (e.g. {TOKEN_ENV}=$(python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'))"
        )
    from grpo_core.serving.limits import tls_options, uvicorn_options, warn_if_exposed

    try:
        tls = tls_options(args.ssl_certfile, args.ssl_keyfile)
    except ValueError as exc:
        sys.exit(str(exc))
    sock = listen(server_cfg.host, server_cfg.port)
    port = sock.getsockname()[1]
    if args.port_file:
        atomic_write_text(args.port_file, str(port))

    import torch
    import uvicorn

    from grpo_core.models import load_model, resolve_model_dir
    from grpo_core.serving.embedded.app import ServerState, create_app
    from grpo_core.serving.embedded.engine import Engine
    from grpo_core.serving.embedded.weights import WeightManager
    from grpo_core.serving.sampling_defaults import generation_config_defaults

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(model_cfg, device)
    eos = {t for t in (tokenizer.eos_token_id, *_as_list(model.generation_config.eos_token_id)) if t is not None}
    kv_size = server_cfg.kv_cache_size_tokens or server_cfg.max_num_seqs * server_cfg.max_model_len
    engine = Engine(
        model,
        eos_token_ids=eos,
        max_model_len=server_cfg.max_model_len,
        max_num_seqs=server_cfg.max_num_seqs,
        kv_cache_size_tokens=max(kv_size, server_cfg.max_model_len),
        pad_token_id=tokenizer.pad_token_id or 0,
    )
    engine.start()
    model_dir = resolve_model_dir(model_cfg)
    defaults = (
        {}
        if args.generation_config == "vllm"
        else generation_config_defaults(model_dir if args.generation_config == "auto" else args.generation_config)
    )
    if defaults:
        logger.warning(
            "default sampling parameters overridden by the generation config (%s): %s; requests that "
            "omit these fields use them (--generation-config vllm for neutral defaults)",
            args.generation_config,
            defaults,
        )
    state = ServerState(
        engine=engine,
        tokenizer=tokenizer,
        weights=WeightManager(engine, args.max_lora_rank, model_dir),
        model_name=server_cfg.served_model_name or model_cfg.name,
        model_path=str(model_dir),
        max_logprobs=server_cfg.max_logprobs,
        max_loras=args.max_loras,
        generation_config=args.generation_config,
        default_sampling=defaults,
        guard={"max_pause_s": args.max_pause_s, "adapter_dir": args.adapter_dir, "weights_dir": args.weights_dir},
    )
    logger.info(
        "embedded server for %s on %s://%s:%d (%s, %d threads, eos=%s)",
        state.model_name,
        "https" if tls else "http",
        server_cfg.host,
        port,
        device,
        torch.get_num_threads(),
        sorted(eos),
    )
    warn_if_exposed(server_cfg.host, "the embedded generation server", tls=bool(tls))
    config = uvicorn.Config(
        create_app(state),
        log_level="warning",
        timeout_keep_alive=60,
        timeout_graceful_shutdown=5,
        **uvicorn_options(),
        **tls,
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        engine.stop()


def _as_list(value: object) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, validate them into the typed config, then serve."""
    from grpo_core.run import lifeline

    lifeline.watch()  # launched by a run: end with it
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        model_cfg = ModelConfig(
            name=args.model, revision=args.revision, dtype=args.dtype, cache_dir=args.cache_dir, seed=args.model_seed
        )
        server_cfg = ServerConfig(
            backend="embedded",
            host=args.host,
            port=args.port,
            served_model_name=args.served_model_name,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            kv_cache_size_tokens=args.kv_cache_size_tokens,
            max_logprobs=args.max_logprobs,
        )
    except ValueError as exc:
        sys.exit(f"invalid argument: {exc}")
    serve(args, model_cfg, server_cfg)
