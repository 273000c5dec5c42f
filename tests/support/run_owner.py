"""Stand-in for a flow-run process (killed by ``test_process_lifetimes``): starts a run's children the way the
flow does — the embedded server (``launch``), the rollout process (``start_rollout_process``) and torchrun with its rank
(``stream``) — then waits to be killed.

Usage: ``python tests/support/run_owner.py CONFIG``
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

from grpo_core.config import load_config
from grpo_core.rollout.process import start_rollout_process
from grpo_core.run.processes import child_env, stream
from grpo_core.security.auth import TOKEN_ENV, new_token
from grpo_core.serving.launch import embedded_command, launch


def main(config: Path) -> None:
    token = new_token()  # the run's bearer token, as the flow's RunProcesses holds it
    env = child_env({TOKEN_ENV: token, "OMP_NUM_THREADS": "1"})
    launch(embedded_command(load_config(config, []), 0), token)
    start_rollout_process(config, ["http://127.0.0.1:9"], config.parent, env=env)
    trainer = [
        sys.executable,
        "-m",
        "grpo_core.train.launch",
        "--nproc-per-node",
        "1",
        "-m",
        "grpo_core.train",
        "--config",
        str(config),
    ]
    threading.Thread(target=stream, args=(trainer, logging.getLogger("trainer"), "", env), daemon=True).start()
    time.sleep(3600)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
