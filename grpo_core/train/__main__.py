"""``python -m grpo_core.train --config FILE`` (also under torchrun): the trainer process.

The config (the trainer's sub-config the flow writes, ``train_config.json``, or a whole run config turned into
one: ``grpo_core.config.load_trainer_config``) is parsed and validated before torch is imported, so ``--help``
and config errors are instant. The trainer reads nothing else of the run config.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    p = argparse.ArgumentParser(prog="python -m grpo_core.train", description=__doc__.splitlines()[0])
    p.add_argument(
        "--config",
        required=True,
        type=Path,
        help="trainer sub-config (train_config.json) or run config (YAML, JSON or TOML)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. train.max_steps=5 (repeatable; values are YAML scalars)",
    )
    p.add_argument("--server-url", action="append", default=[], help="generation server to sync weights to")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    from grpo_core.run import lifeline

    # Under torchrun the rank has its own session (torch 2.11): it must also end when torchrun does.
    lifeline.watch(parent="TORCHELASTIC_RUN_ID" in os.environ)
    args = parse_args(argv)
    from grpo_core.config import load_trainer_config
    from grpo_core.errors import ConfigError
    from grpo_core.security.redact import secrets_from_env

    try:
        # the flow's GRPO_RUN_SECRETS: the secrets of the trainer's sub-config, under their run-config paths
        cfg = load_trainer_config(args.config, args.set, secrets=secrets_from_env(os.environ))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)  # noqa: T201 - command-line error before logging is set up
        return 2
    rank = os.environ.get("RANK", "0")  # the global rank torchrun gave (the PID would read as a rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    from .run import run_trainer

    try:
        run_trainer(cfg, server_urls=args.server_url)
    except BaseException as exc:
        # The flow quotes this file as the cause; torchrun's own report only says a rank failed. BaseException:
        # DCP's CheckpointException is one (a Ctrl-C or an exit is no failure of the trainer's).
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            from grpo_core.tracking.report import write_trainer_error

            write_trainer_error(cfg.train.output_dir, int(os.environ.get("RANK", "0")), exc)
        raise
    return 0


def exit_now(code: int) -> None:
    """End a finished trainer rank without the interpreter's teardown: flush logs and standard streams, then
    ``os._exit``.

    Everything the run writes is closed by then (checkpoint, final model, metrics sink, process group). What is
    skipped is the teardown of native threads still parked in torch, gloo and Arrow, which at exit can abort a rank
    that has already finished ("terminate called without an active exception", SIGABRT): torchrun then reports the
    whole run failed. Seen once in CI on a 2-rank CPU run (gloo) after its last checkpoint.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said on it
            pass
    os._exit(code)


if __name__ == "__main__":
    code = main()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank: see exit_now
        exit_now(code)
    sys.exit(code)
