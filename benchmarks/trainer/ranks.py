"""``python -m benchmarks.trainer ranks``: the real trainer under torchrun on 1 and 2 devices (see ``__main__.py``)."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch
import yaml

from grpo_core.packing import write_samples_ipc
from grpo_core.run.children import start_child, stop_child
from grpo_core.run.commands import local_trainer_command
from grpo_core.run.layout import METRICS
from grpo_core.tracking.metrics import JsonlSink

from .workload import DEVICE, packer_name, print_table, qwen3_config, workload, write_json

ROOT = Path(__file__).resolve().parents[2]
#: Kept off in every child, as the machines that lend several GPUs require (NVLink multicast).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def add_ranks_args(q) -> None:
    """Arguments of ``ranks``."""
    q.add_argument("--shape", default="0.6b", help="tiny, 0.6b, 1.7b or 4b")
    q.add_argument("--nproc", default="1,2", help="comma-separated rank counts, each a run of its own")
    q.add_argument("--steps", type=int, default=10, help="optimizer steps per run, resume included")
    q.add_argument(
        "--resume-at",
        type=int,
        default=8,
        help="the largest rank count checkpoints here, stops and resumes (0 = no resume)",
    )
    q.add_argument("--resume-all", action="store_true", help="every rank count stops and resumes")
    q.add_argument("--length-buckets", type=int, default=4)
    q.add_argument("--workdir", default=None, help="model, samples and run folders (default: a temporary one)")
    q.add_argument("--timeout-s", type=float, default=270.0, help="limit of each torchrun")
    q.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra train.KEY=VALUE (YAML scalar) for every run",
    )
    q.set_defaults(groups=72)  # 10 steps of 2 ranks × 16k-token tree rows (~3 groups of 8 each)


def make_model(shape: str, path: Path) -> Path:
    """A random-weight model folder of ``shape`` (bf16 safetensors, config.json; built on the device)."""
    from transformers import AutoModelForCausalLM

    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    with torch.device(DEVICE):
        lm = AutoModelForCausalLM.from_config(qwen3_config(shape), dtype=torch.bfloat16)
    lm.save_pretrained(path)
    return path


def run_config(args, work: Path, model: Path, out: Path, max_steps: int, save_steps: int) -> Path:
    """The trainer's YAML config for one run."""
    train = {
        "output_dir": str(out),
        "samples_path": str(work / "samples.arrow"),
        "max_steps": max_steps,
        "save_steps": save_steps,
        "logging_steps": 1,
        "score_centering": args.topk > 0,
        "length_buckets": args.length_buckets,
        "learning_rate": 1e-6,
    }
    for kv in args.sets:
        key, _, value = kv.partition("=")
        train[key] = yaml.safe_load(value)
    cfg = {
        "model": {"name": str(model)},
        "server": {"max_model_len": 4096},
        "rollout": {"max_completion_length": 1024, "num_sampler_logprobs": args.topk, "temperature": 1.0},
        "packing": {"token_budget": args.budget, "backend": packer_name()},
        "train": train,
        "tracking": {"enabled": False},
    }
    path = out.parent / f"{out.name}-{max_steps}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def torchrun(config: Path, nproc: int, log: Path, timeout_s: float) -> None:
    """``torchrun --nproc-per-node N -m grpo_core.train --config FILE``; raises with the log's tail on failure."""
    env = {
        **os.environ,
        **NCCL_ENV,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
    }
    env.setdefault("OMP_NUM_THREADS", "4")
    cmd = local_trainer_command(config, nproc)  # the flow's own launch (grpo_core.run.commands)
    with open(log, "a") as f:
        proc = start_child(cmd, cwd=ROOT, env=env, stdout=f)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_child(proc, timeout_s=0)
            code = "timeout"
    if code != 0:
        raise RuntimeError(f"torchrun ({nproc} ranks) ended with {code}:\n" + log.read_text()[-3000:])


def summary(metrics: list[dict], nproc: int, resume_at: int) -> dict:
    """Steady rates and step-time spread of one run (every step comes after its warm-up)."""
    steps = [m["perf/step_s"] for m in metrics]
    total = sum(steps)
    warm = {m["step"]: m["perf/compile_warmup_s"] for m in metrics if "perf/compile_warmup_s" in m}
    med = statistics.median(steps)
    mfu = [m["perf/fwd_bwd_mfu"] for m in metrics if "perf/fwd_bwd_mfu" in m]
    return {
        "ranks": nproc,
        "steps": len(metrics),
        "forwarded_tokens_per_s": sum(m["batch/forwarded_tokens_per_step"] for m in metrics) / total,
        "trained_tokens_per_s": sum(m["batch/trained_tokens_per_step"] for m in metrics) / total,
        "mfu": statistics.mean(mfu) if mfu else None,
        "warmup_s": warm.get(1),
        "resume_warmup_s": warm.get(resume_at + 1) if resume_at else None,
        "recompiles": sum(m.get("perf/recompile_count", 0) for m in metrics),
        "median_step_s": med,
        "max_over_median": max(steps) / med,
        "slowest_step": metrics[steps.index(max(steps))]["step"],
        "pad_frac": statistics.mean(m["batch/pad_frac"] for m in metrics),
        "packing_ratio": statistics.mean(m["batch/packing_ratio"] for m in metrics),
        "step_times_s": steps,
    }


def ranks(args) -> list[dict]:
    """See module docs; one dict per rank count (the last with the scaling over the first)."""
    work = Path(args.workdir or tempfile.mkdtemp(prefix="grpo-trainer-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model = make_model(args.shape, work / f"model-{args.shape}")
    vocab = qwen3_config(args.shape).vocab_size
    lengths = dict(prompt_len=64, completion_len=(8, 64)) if args.shape == "tiny" else {}
    write_samples_ipc(work / "samples.arrow", workload(args.groups, args.group_size, vocab, topk=args.topk, **lengths))
    results, counts = [], [int(x) for x in args.nproc.split(",")]
    for n in counts:
        resume_at = args.resume_at if (args.resume_all or n == max(counts)) else 0
        out = work / f"ranks-{n}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        log = work / f"ranks-{n}.log"
        log.unlink(missing_ok=True)
        if resume_at:
            torchrun(run_config(args, work, model, out / "run", resume_at, resume_at), n, log, args.timeout_s)
        torchrun(run_config(args, work, model, out / "run", args.steps, args.steps), n, log, args.timeout_s)
        if resume_at and "resumed from" not in log.read_text():
            raise RuntimeError(f"the {n}-rank run did not resume; see {log}")
        metrics = JsonlSink.read(out / "run" / METRICS)
        results.append(summary(metrics, n, resume_at))
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            shutil.copy(log, Path(args.out) / log.name)
    if len(results) > 1:
        results[-1]["scaling"] = results[-1]["trained_tokens_per_s"] / results[0]["trained_tokens_per_s"]
    print_table(results, COLUMNS)
    write_json(args.out, "trainer_ranks.json", results)
    return results


COLUMNS = [
    ("ranks", "ranks", ""),
    ("steps", "steps", ""),
    ("forwarded_tokens_per_s", "fwd tok/s", "{:,.0f}"),
    ("trained_tokens_per_s", "trained tok/s", "{:,.0f}"),
    ("scaling", "scaling", "{:.2f}"),
    ("mfu", "MFU", "{:.1%}"),
    ("packing_ratio", "pack", "{:.2f}"),
    ("pad_frac", "pad", "{:.3f}"),
    ("warmup_s", "warm-up s", "{:.1f}"),
    ("resume_warmup_s", "resume warm-up s", "{:.1f}"),
    ("recompiles", "recompiles", ""),
    ("median_step_s", "median s", "{:.3f}"),
    ("max_over_median", "max/med", "{:.2f}"),
    ("slowest_step", "slowest", ""),
]
