"""Trainer vs sampler log-prob parity of dumped rollouts: which side is off at staleness 0 (issue 12).

Reads the rollouts the rollout process dumped with ``GRPO_DEBUG_ROLLOUT_DUMP=<file>``
(:mod:`grpo_core.rollout.debug_dump`: token ids, the sampler's log μ per sampled token) and recomputes
log π of every sampled token three ways, on the same weights (``--model-dir``, the checkpoint the
sampler served before any update):

* ``hf_fp32``: Hugging Face transformers, fp32, eager attention, one sequence at a time (the reference);
* ``hf_bf16``: the same in bf16 (logits upcast to fp32 before the softmax, as vLLM's sampler);
* ``trainer``: the trainer's own path: :class:`grpo_core.train.trainer.Trainer` built from the run config
  (``--config``, a whole run config, or defaults; its trainer sub-config as the flow gives it), the sequences
  packed into tree rows by its planner and packer under the run's token budget, padded to its length buckets,
  FlexAttention block masks and ``torch.compile`` on CUDA, FSDP2 mixed precision, and the fused log-prob head
  (:meth:`Trainer.row_loss`, then the backward as in training; no optimizer step).

Printed: for each path, the mean of exp(log π − log μ) over the sampled tokens (the staleness-0
importance ratio; 1 when both sides compute the same distribution: E_μ[π/μ] = 1), mean and max
|Δlog p|; ``trainer_loss_ratio``: the ratio the loss itself computed (what
``sampling/importance_sampling_ratio/mean`` averages; differs from ``trainer_vs_sampler`` if μ is altered
on its way to the head); the same for ``trainer`` against ``hf_fp32``; the 10 worst tokens of ``trainer`` vs ``hf_fp32``
(position in the sequence, packed position in its row, row length and bucket, token id) and of
``hf_fp32`` vs the sampler. A large ``hf_fp32`` vs μ gap with ``trainer`` ≈ ``hf_fp32`` puts the fault
in the sampler's log-probs; ``hf_fp32`` ≈ μ with ``trainer`` off puts it in the trainer's path.
The figures also go to ``--out`` (default ``<dump>.parity.json``).
``--stale-masks`` (CUDA) builds every micro-batch's FlexAttention mask before the step's first forward,
the trainer's order before its fix (rows of one length bucket share the ``mask_mod``'s buffer, so every
earlier row then attends with the last row's tree): per-row figures show what that did.

Run (GPU box; a 1-process world is created, no torchrun needed)::

    python benchmarks/logprob_parity.py --dump rollouts.jsonl --model-dir DIR --device cuda \\
        [--config configs/gpu-1xh200.yaml]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from grpo_core.config import RunConfig, load_config  # noqa: E402
from grpo_core.packing import Sample, write_samples_ipc  # noqa: E402
from grpo_core.rollout.scoring import token_lists  # noqa: E402

WORST = 10


@dataclass
class Sequence:
    """One dumped training sequence: ``input_ids`` (``int[T]``), trained positions ``t`` (``int[M]``), the
    sampler's log μ there (``float64[M]``) and optional top-k entries; plus per-path log π (``float64[M]``)
    and, for the trainer path, where each token sat (``row``, ``row_pos``, ``row_len``, ``bucket``)."""

    input_ids: list[int]
    completion_mask: list[int]
    sampler_logprobs: list[float]
    topk: list | None
    group_id: int
    prompt_index: int
    line: int
    logp: dict[str, np.ndarray] = field(default_factory=dict)
    where: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def trained(self) -> np.ndarray:
        return np.nonzero(np.asarray(self.completion_mask))[0]

    @property
    def mu(self) -> np.ndarray:
        return np.asarray(self.sampler_logprobs, dtype=np.float64)[self.trained]


def read_dump(path: Path) -> tuple[list[Sequence], dict]:
    """The dump's sequences (file order) and its sampling settings.

    Raises:
        ValueError: empty dump, or lines sampled with different settings.
    """
    seqs, sampling = [], None
    for n, text in enumerate(path.read_text().splitlines()):
        if not text.strip():
            continue
        rec = json.loads(text)
        if sampling is not None and rec["sampling"] != sampling:
            raise ValueError(f"{path}:{n + 1}: sampling {rec['sampling']} differs from the first line's {sampling}")
        sampling = rec["sampling"]
        for s in rec["sequences"]:
            seqs.append(
                Sequence(
                    s["input_ids"],
                    s["completion_mask"],
                    s["sampler_logprobs"],
                    s.get("topk"),
                    rec["group_id"],
                    rec["prompt_index"],
                    n + 1,
                )
            )
    if not seqs:
        raise ValueError(f"{path} holds no rollout; run the rollout with GRPO_DEBUG_ROLLOUT_DUMP={path}")
    return seqs, sampling


# -- (a), (b): plain Hugging Face forwards ---------------------------------------------------------------


def hf_logprobs(
    model_dir: str, seqs: list[Sequence], dtype: torch.dtype, device: torch.device, temperature: float, name: str
) -> None:
    """log π of each sequence's trained tokens from one eager transformers forward per sequence
    (``log_softmax(logits.float() / T)``), stored as ``seq.logp[name]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").to(device)
    model.eval()
    t = temperature if temperature > 0 else 1.0
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor(s.input_ids, dtype=torch.long, device=device)[None]
            logits = model(input_ids=ids, use_cache=False).logits[0].float() / t
            logp = torch.log_softmax(logits, -1)
            pos = torch.as_tensor(s.trained, device=device)
            s.logp[name] = logp[pos - 1, ids[0, pos]].double().cpu().numpy()
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- (c): the trainer's own path -------------------------------------------------------------------------


def run_config(args, sampling: dict, work: Path, with_topk: bool) -> RunConfig:
    """The run config the trainer path uses: ``--config`` (or defaults) with the model, device, samples file
    and output folder of this check; the dump's temperature must be the config's."""
    cfg = load_config(args.config) if args.config else RunConfig()
    data = cfg.model_dump(mode="python")
    data["model"]["name"] = str(args.model_dir)
    data["tracking"]["enabled"] = False
    if args.config is None:
        data["rollout"].update({k: sampling[k] for k in ("temperature", "top_k", "top_p", "min_p")})
        data["packing"]["token_budget"] = args.token_budget
    elif not math.isclose(cfg.rollout.temperature, sampling["temperature"]):
        raise ValueError(
            f"--config has rollout.temperature={cfg.rollout.temperature} but the dump was sampled "
            f"at {sampling['temperature']}; give the run's own config"
        )
    if not with_topk:
        data["rollout"]["num_sampler_logprobs"] = 0
        data["train"]["score_centering"] = False
    data["train"].update(
        device=args.device,
        samples_path=str(work / "samples.arrow"),
        output_dir=str(work / "out"),
        max_steps=10**6,
        max_untrainable_groups=10**6,
    )
    return RunConfig.model_validate(data)


def to_samples(seqs: list[Sequence], with_topk: bool) -> list[Sample]:
    """Sample objects of the sequences (sample id = index; advantage 1: any non-zero value, it does not reach
    the log-probs)."""
    out = []
    for i, s in enumerate(seqs):
        sample = Sample.build(
            s.input_ids,
            s.completion_mask,
            s.sampler_logprobs,
            sample_id=i,
            group_id=s.group_id,
            prompt_index=s.prompt_index,
            advantage=1.0,
            policy_version=0,
        )
        if with_topk:  # as the rollout encodes them (grpo_core.rollout.scoring)
            sample.sampler_topk = token_lists([{int(k): v for k, v in e} for e in s.topk or [[] for _ in s.input_ids]])
        out.append(sample)
    return out


def trainer_logprobs(args, seqs: list[Sequence], sampling: dict) -> dict:
    """log π of every trained token through :class:`Trainer` (see the module docs), stored as
    ``seq.logp["trainer"]`` with ``seq.where`` (row, packed position, row length, bucket); returns facts
    of the set-up (buckets, compiled, dtype, rows, tokens the planner dropped)."""
    import torch.distributed as dist

    from grpo_core.train.distributed import init_world
    from grpo_core.train.trainer import Trainer
    from grpo_core.transport.file_source import ArrowFileSource

    with_topk = any(s.topk for s in seqs)
    work = Path(tempfile.mkdtemp(prefix="logprob_parity_"))
    cfg = run_config(args, sampling, work, with_topk)
    write_samples_ipc(work / "samples.arrow", to_samples(seqs, with_topk))
    for s in seqs:
        s.logp["trainer"] = np.full(len(s.trained), np.nan)
        s.logp["trainer_metric"] = np.full(len(s.trained), np.nan)
        s.where["trainer"] = np.full((len(s.trained), 4), -1, dtype=np.int64)
    world = init_world(args.device)
    try:
        trainer = Trainer(cfg.trainer_process(), world, ArrowFileSource(work / "samples.arrow"))
        trainer.warmup()
        rows_done, row_steps, step = 0, [], 0
        while True:
            rows, terms, _ = trainer.collect_step()
            if not rows:
                break
            tensors = [trainer._tensors(r) for r in rows]
            if args.stale_masks and trainer.flex is not None:  # the order before the fix: every mask up front
                for rt in tensors:
                    rt.tree_mask = trainer.flex.build(rt.tree_mask.subtree_end, rt.tree_mask.length)
                    rt.tree_mask.owner = None  # let the stale masks through the policy's check
            for mb, (row, rt, norm) in enumerate(zip(rows, tensors, trainer.loss_normalisers(terms))):
                row_steps.append([step, mb])
                res = trainer.row_loss(rt, norm)
                res.loss.backward()
                trainer.optimizer.zero_grad(set_to_none=True)
                _scatter(
                    seqs,
                    row,
                    res.logprobs.logprobs.detach().double().cpu().numpy(),
                    res.stats["ratio"].detach().double().cpu().numpy(),
                    rows_done,
                    rt.tree_mask.length,
                )
                rows_done += 1
            step += 1
        facts = {
            "buckets": list(trainer.buckets or ()),
            "compiled": trainer.compiled,
            "flex_attention": trainer.flex is not None,
            "train_dtype": cfg.train.dtype,
            "mixed_precision": cfg.train.mixed_precision,
            "token_budget": cfg.token_budget(),
            "gradient_accumulation_steps": cfg.train.gradient_accumulation_steps,
            "rows": rows_done,
            "fp32_logits": cfg.train.fp32_logits,
            "stale_masks": args.stale_masks,
            "row_steps": row_steps,
        }
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return facts


def _scatter(seqs: list[Sequence], row, logp: np.ndarray, ratio: np.ndarray, row_number: int, bucket: int) -> None:
    """Put a row's per-term log-probs back on their sequences (sequence position = depth of the predicting
    token + 1; checked against the target id), and the loss's own ratio π/μ as ``trainer_metric`` (stored as
    log ratio + log μ, so that :func:`compare` against μ gives the ratio the trainer logs)."""
    token_index = row.column("token_index").astype(np.int64)
    sample_index = row.column("sample_index").astype(np.int64)
    target = row.column("target_id").astype(np.int64)
    depth = row.column("position_ids").astype(np.int64)
    sample_ids = row.samples.column("sample_id").to_numpy()
    for j in range(len(token_index)):
        s = seqs[int(sample_ids[sample_index[j]])]
        t = int(depth[token_index[j]]) + 1
        if s.input_ids[t] != target[j]:
            raise AssertionError(f"row {row_number} term {j}: target {target[j]} is not token {t} of its sequence")
        k = int(np.searchsorted(s.trained, t))
        s.logp["trainer"][k] = logp[j]
        s.logp["trainer_metric"][k] = math.log(ratio[j]) + s.sampler_logprobs[t] if ratio[j] > 0 else np.nan
        s.where["trainer"][k] = (row_number, int(token_index[j]), row.num_forwarded, bucket)


# -- comparison ------------------------------------------------------------------------------------------


def compare(seqs: list[Sequence], name: str, ref: str | None) -> dict:
    """Mean of exp(logp[name] − logp[ref]) (ref None = the sampler's μ), mean/max |Δ|, and the worst tokens."""
    rows = []
    for i, s in enumerate(seqs):
        a = s.logp[name]
        b = s.mu if ref is None else s.logp[ref]
        for k, t in enumerate(s.trained):
            if np.isnan(a[k]) or np.isnan(b[k]):
                continue
            where = s.where.get("trainer", np.full((len(s.trained), 4), -1))[k]
            rows.append((a[k] - b[k], i, int(t), s.input_ids[t], where, s.line))
    if not rows:
        return {"tokens": 0}
    d = np.array([r[0] for r in rows])
    worst = np.argsort(-np.abs(d))[:WORST]
    return {
        "tokens": len(d),
        "ratio_mean": float(np.mean(np.exp(d))),
        "abs_logp_diff_mean": float(np.mean(np.abs(d))),
        "abs_logp_diff_max": float(np.max(np.abs(d))),
        "logp_diff_mean": float(np.mean(d)),
        "worst": [
            {
                "delta_logp": float(rows[w][0]),
                "sequence": rows[w][1],
                "dump_line": rows[w][5],
                "seq_pos": rows[w][2],
                "token_id": int(rows[w][3]),
                "row": int(rows[w][4][0]),
                "row_pos": int(rows[w][4][1]),
                "row_len": int(rows[w][4][2]),
                "bucket": int(rows[w][4][3]),
            }
            for w in worst
        ],
    }


def by_row(seqs: list[Sequence], ref: str, row_steps: list[list[int]]) -> list[dict]:
    """Trainer vs ``ref`` per packed row (in the trainer's order, with its step and micro-batch): tokens, bucket,
    mean exp(Δ), mean and max |Δ|."""
    rows: dict[int, list] = {}
    for s in seqs:
        d = s.logp["trainer"] - s.logp[ref]
        for k in range(len(s.trained)):
            r, _, n, bucket = s.where["trainer"][k]
            if r >= 0 and np.isfinite(d[k]):
                rows.setdefault(int(r), [int(n), int(bucket), []])[2].append(d[k])
    out = []
    for r in sorted(rows):
        n, bucket, d = rows[r][0], rows[r][1], np.array(rows[r][2])
        out.append(
            {
                "row": r,
                "step": row_steps[r][0],
                "micro_batch": row_steps[r][1],
                "row_len": n,
                "bucket": bucket,
                "tokens": len(d),
                "ratio_mean": float(np.mean(np.exp(d))),
                "abs_logp_diff_mean": float(np.mean(np.abs(d))),
                "abs_logp_diff_max": float(np.max(np.abs(d))),
            }
        )
    return out


def print_report(results: dict) -> None:
    print(f"{'comparison':<22}{'tokens':>8}{'mean exp(Δ)':>14}{'mean |Δ|':>12}{'max |Δ|':>12}")
    for key, r in results["comparisons"].items():
        if r["tokens"]:
            print(
                f"{key:<22}{r['tokens']:>8}{r['ratio_mean']:>14.6f}{r['abs_logp_diff_mean']:>12.2e}"
                f"{r['abs_logp_diff_max']:>12.2e}"
            )
    for key in ("trainer_vs_hf_fp32", "hf_fp32_vs_sampler"):
        r = results["comparisons"].get(key)
        if not r or not r["tokens"]:
            continue
        print(f"\nworst tokens, {key}:")
        print(
            f"{'Δlogp':>10}{'seq':>6}{'line':>6}{'seq_pos':>9}{'token':>8}{'row':>5}{'row_pos':>9}"
            f"{'row_len':>9}{'bucket':>8}"
        )
        for w in r["worst"]:
            print(
                f"{w['delta_logp']:>10.2e}{w['sequence']:>6}{w['dump_line']:>6}{w['seq_pos']:>9}{w['token_id']:>8}"
                f"{w['row']:>5}{w['row_pos']:>9}{w['row_len']:>9}{w['bucket']:>8}"
            )
    print("\ntrainer vs hf_fp32 per packed row:")
    print(
        f"{'row':>5}{'step':>5}{'mb':>4}{'row_len':>9}{'bucket':>8}{'tokens':>8}"
        f"{'mean exp(Δ)':>14}{'mean |Δ|':>12}{'max |Δ|':>12}"
    )
    for r in results["trainer_rows"]:
        print(
            f"{r['row']:>5}{r['step']:>5}{r['micro_batch']:>4}{r['row_len']:>9}{r['bucket']:>8}{r['tokens']:>8}{r['ratio_mean']:>14.6f}"
            f"{r['abs_logp_diff_mean']:>12.2e}{r['abs_logp_diff_max']:>12.2e}"
        )
    print("\nset-up:", json.dumps(results["setup"]))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", type=Path, required=True, help="JSON lines written under GRPO_DEBUG_ROLLOUT_DUMP")
    ap.add_argument("--model-dir", required=True, help="the Hugging Face folder the sampler served (version 0)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--config", default=None, help="the run's config (token budget, buckets, dtype, compile...)")
    ap.add_argument("--token-budget", type=int, default=8192, help="row token budget without --config")
    ap.add_argument(
        "--stale-masks",
        action="store_true",
        help="CUDA: build every micro-batch's FlexAttention mask before the step's first forward, as the "
        "trainer did before the shared-bucket-buffer fix (shows what that ordering did)",
    )
    ap.add_argument("--skip-bf16", action="store_true", help="leave out the bf16 Hugging Face forward")
    ap.add_argument("--out", type=Path, default=None, help="JSON of the figures (default <dump>.parity.json)")
    args = ap.parse_args(argv)
    seqs, sampling = read_dump(args.dump)
    device = torch.device(args.device)
    temperature = sampling["temperature"]
    hf_logprobs(args.model_dir, seqs, torch.float32, device, temperature, "hf_fp32")
    if not args.skip_bf16:
        hf_logprobs(args.model_dir, seqs, torch.bfloat16, device, temperature, "hf_bf16")
    setup = trainer_logprobs(args, seqs, sampling)
    setup.update(
        sampling=sampling,
        device=args.device,
        sequences=len(seqs),
        sampled_tokens=int(sum(len(s.trained) for s in seqs)),
        trainer_tokens=int(sum(np.isfinite(s.logp["trainer"]).sum() for s in seqs)),
    )
    comparisons = {"hf_fp32_vs_sampler": compare(seqs, "hf_fp32", None)}
    if not args.skip_bf16:
        comparisons["hf_bf16_vs_sampler"] = compare(seqs, "hf_bf16", None)
    comparisons["trainer_vs_sampler"] = compare(seqs, "trainer", None)
    comparisons["trainer_loss_ratio"] = compare(seqs, "trainer_metric", None)  # what the ratio metric averages
    comparisons["trainer_vs_hf_fp32"] = compare(seqs, "trainer", "hf_fp32")
    if not args.skip_bf16:
        comparisons["trainer_vs_hf_bf16"] = compare(seqs, "trainer", "hf_bf16")
    results = {"setup": setup, "comparisons": comparisons, "trainer_rows": by_row(seqs, "hf_fp32", setup["row_steps"])}
    print_report(results)
    out = args.out or args.dump.with_suffix(".parity.json")
    out.write_text(json.dumps(results, indent=1))
    print(f"figures: {out}")
    return results


if __name__ == "__main__":
    main()
