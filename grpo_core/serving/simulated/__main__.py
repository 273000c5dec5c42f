"""``python -m grpo_core.serving.simulated --engines N --port P``: serve N simulated engines on ports P..P+N-1.

Prints one JSON line ``{"urls": [...]}`` on stdout once every engine listens (port 0: free ports), then serves
until interrupted. ``--help`` lists the cost model, limits and distributions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from grpo_core.serving.embedded.server import port_number


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line (errors name the option and exit 2)."""
    from grpo_core.serving.simulated.cost import CALIBRATION_SOURCE, CALIBRATIONS

    p = argparse.ArgumentParser(
        prog="python -m grpo_core.serving.simulated",
        description="Simulated vLLM engines whose decode step costs a + b x running sequences (asyncio time).",
    )
    p.add_argument("--engines", type=int, default=1, help="engines in this process, one port each (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback)")
    p.add_argument(
        "--port", type=port_number, default=0, help="first port; engine i listens on port + i (0: free ports)"
    )
    p.add_argument(
        "--calibration",
        choices=sorted(CALIBRATIONS),
        default="h200",
        help=f"a and b of the step cost (h200: a 2.227 ms, b 15.64 us, {CALIBRATION_SOURCE}; "
        "h200-client-bound: 3 ms, 90 us, issue 25's run-level fit)",
    )
    p.add_argument("--a-ms", type=float, help="fixed step cost, ms (overrides the calibration)")
    p.add_argument("--b-us", type=float, help="cost per running sequence per step, us (overrides the calibration)")
    p.add_argument("--c-us", type=float, default=2.0, help="prefill cost per prompt token, us (default 2)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply every simulated duration (default 1)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-budget-tokens", type=int, help="KV cache in tokens (default max-num-seqs x max-model-len)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--eos-token-id", type=int, default=0, help="last token of an early stop (-1: random)")
    p.add_argument("--lengths", default="lognormal:120:0.6", help="fixed:L | uniform:LO:HI | lognormal:MEDIAN:SIGMA")
    p.add_argument("--update-s", type=float, default=0.0, help="seconds one /update_weights takes")
    p.add_argument("--lora-load-s", type=float, default=0.0, help="seconds one LoRA load takes")
    p.add_argument("--model-name", default="simulated")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.engines < 1:
        p.error(f"--engines must be >= 1, got {args.engines}")
    if not 0 <= args.port <= 65535 - args.engines:
        p.error(f"--port must leave room for {args.engines} ports below 65536, got {args.port}")
    for name in ("a_ms", "b_us", "c_us", "update_s", "lora_load_s"):
        value = getattr(args, name)
        if value is not None and value < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    if args.time_scale <= 0:
        p.error(f"--time-scale must be > 0, got {args.time_scale}")
    return args


def build(args: argparse.Namespace):  # noqa: ANN201 - (CostModel, EngineSettings), imported late
    """The cost model and engine settings the arguments describe.

    Raises:
        ValueError: inconsistent values (e.g. a KV budget below max-model-len, a bad --lengths spec), named.
    """
    from grpo_core.serving.simulated.cost import CostModel, LengthDistribution, calibration
    from grpo_core.serving.simulated.engine import EngineSettings

    base = calibration(args.calibration, args.time_scale, args.c_us * 1e-6)
    cost = CostModel(
        base.a_s if args.a_ms is None else args.a_ms * 1e-3,
        base.b_s if args.b_us is None else args.b_us * 1e-6,
        base.c_s,
        args.time_scale,
    )
    settings = EngineSettings(
        max_num_seqs=args.max_num_seqs,
        kv_budget_tokens=args.kv_budget_tokens or args.max_num_seqs * args.max_model_len,
        max_model_len=args.max_model_len,
        vocab_size=args.vocab_size,
        eos_token_id=None if args.eos_token_id < 0 else args.eos_token_id,
        lengths=LengthDistribution.parse(args.lengths),
        update_s=args.update_s,
        lora_load_s=args.lora_load_s,
        seed=args.seed,
        model_name=args.model_name,
    )
    return cost, settings


def main(argv: list[str] | None = None) -> int:
    """Serve until interrupted; exit 2 on bad arguments."""
    args = parse_args(argv)
    try:
        cost, settings = build(args)
    except ValueError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    from grpo_core.serving.simulated.server import bind_sockets, make_engines, serve, urls_of

    sockets = bind_sockets(args.host, args.port, args.engines)
    urls = urls_of(sockets)

    def ready(_servers: object) -> None:
        sys.stdout.write(json.dumps({"urls": urls}) + "\n")
        sys.stdout.flush()

    try:
        asyncio.run(serve(make_engines(args.engines, cost, settings), sockets, ready))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
