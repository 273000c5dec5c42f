"""``python -m grpo_core.rollout --config FILE --server-url URL``: the rollout process.

Started by ``grpo_core.rollout.process.start_rollout_process`` (the flow, tests and benchmarks alike).

The config is parsed and validated (and the loop class and its ``loop_options`` checked)
before transformers or the HTTP client are imported, so ``--help`` and config errors are
instant. The Flight location is logged and, with ``--location-file``, written to a file
for the trainer (``train.rollout_location``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    p = argparse.ArgumentParser(prog="python -m grpo_core.rollout", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, type=Path, help="run config (YAML, JSON or TOML)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. rollout.seed=3")
    p.add_argument("--server-url", action="append", default=[], required=True, help="generation server (repeatable)")
    p.add_argument("--resume", type=Path, default=None, help="rollout_state.json of the checkpoint to resume from")
    p.add_argument("--error-path", type=Path, default=None, help="where a failure's traceback is written")
    p.add_argument("--location-file", type=Path, default=None, help="write the Flight location here once serving")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    from grpo_core.run import lifeline

    lifeline.watch()  # launched by a run: end with it
    args = parse_args(argv)
    from grpo_core.config import load_config
    from grpo_core.security.redact import secrets_from_env
    from grpo_core.transport.types import ResumeState

    from .build import loop_class_and_config

    cfg = load_config(args.config, args.set, secrets=secrets_from_env(os.environ))  # the flow's GRPO_RUN_SECRETS
    loop_class_and_config(cfg.rollout)  # fail fast on a bad loop class or loop_options
    resume = None
    if args.resume:
        known = {f.name for f in dataclasses.fields(ResumeState)}
        resume = ResumeState(**{k: v for k, v in json.loads(args.resume.read_text()).items() if k in known})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .process import RolloutJob, run_rollout

    job = RolloutJob(
        cfg.rollout_process(),
        args.server_url,
        resume=resume,
        error_path=str(args.error_path) if args.error_path else None,
    )
    from grpo_core.run.durable import atomic_write_text

    on_ready = (lambda loc: atomic_write_text(args.location_file, loc)) if args.location_file else None
    return run_rollout(job, on_ready=on_ready)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)  # skip interpreter teardown: gRPC and tokenizer threads may still hold locks
