"""``python -m benchmarks.trainer sweep``: rows × modes × shapes on one device (see ``__main__.py``)."""

from __future__ import annotations

import gc
import time

import torch

from grpo_core.train.attention import TREE_ATTENTION, FlexTreeMasks, register_tree_attention
from grpo_core.train.logprobs import LossTerms, fused_grpo_loss, projected_logprobs
from grpo_core.train.loss import LossSettings, grpo_loss
from grpo_core.train.parallelize import apply_layer_wrappers, decoder_layers
from grpo_core.train.policy import Policy
from grpo_core.train.rows import synthetic_row

from .workload import (
    AUTO_CHECKPOINTING,
    DEVICE,
    H200_BF16_PEAK,
    plain_rows,
    print_table,
    qwen3_config,
    run_rows,
    step,
    summarise,
    tree_rows,
    workload,
    write_json,
)


def add_sweep_args(q) -> None:
    """Arguments of ``sweep``."""
    q.add_argument("--shapes", default="0.6b,1.7b,4b", help="comma-separated: tiny, 0.6b, 1.7b, 4b")
    q.add_argument("--modes", default="eager,compiled", help="eager and/or compiled")
    q.add_argument("--steps", type=int, default=4, help="measured rows per row kind and mode")
    q.add_argument(
        "--time-budget-s",
        type=float,
        default=300.0,
        help="configurations that would start later are skipped (compiled ones run first)",
    )
    q.add_argument("--checkpointing", default="auto", help="none|selective|full, or auto (selective for 4b)")
    q.add_argument("--compile-backend", default="inductor", help="aot_eager compiles without a C++ toolchain")
    q.add_argument("--chunk-size", type=int, default=None, help="fused head chunk (default: the trainer's)")
    q.add_argument("--no-check", action="store_true", help="skip the fused-head check on the device")


def head_check(vocab: int, hidden: int, num_terms: int = 2048, topk: int = 8) -> dict:
    """The fused head in the device's dtype against the fp32 reference on the same (rounded) inputs."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    h = (torch.randn(num_terms, hidden, device=DEVICE, generator=g) * 2).to(dtype)
    w = (torch.randn(vocab, hidden, device=DEVICE, generator=g) * 0.05).to(dtype)
    targets = torch.randint(0, vocab, (num_terms,), device=DEVICE, generator=g)
    topk_ids = torch.randint(0, vocab, (num_terms, topk), device=DEVICE, generator=g)
    terms = LossTerms(
        targets,
        torch.full((num_terms,), -12.0, device=DEVICE),
        torch.randn(num_terms, device=DEVICE),
        topk_ids,
        torch.full((num_terms, topk), -12.0, device=DEVICE),
    )
    h32, w32 = h.float().clone().requires_grad_(True), w.float().clone().requires_grad_(True)
    ref = projected_logprobs(h32, w32, targets, 0.9, topk_ids, chunk_size=1024)
    loss, _ = grpo_loss(
        ref.logprobs,
        terms.sampler_logprobs,
        terms.advantages,
        num_terms,
        LossSettings(),
        ref.topk_logprobs,
        terms.sampler_topk_logprobs,
    )
    loss.backward()
    out = {"check": "fused_head_vs_fp32", "dtype": str(dtype).removeprefix("torch.")}
    for compiled in (False, True) if DEVICE.type == "cuda" else (False,):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        res = fused_grpo_loss(hh, ww, terms, num_terms, LossSettings(), 0.9, 1024, compiled)
        res.loss.backward()
        key = "compiled" if compiled else "eager"
        out[f"{key}_logp_max_abs"] = (res.logprobs.logprobs - ref.logprobs).abs().max().item()
        out[f"{key}_grad_h_rel"] = ((hh.grad.float() - h32.grad).norm() / h32.grad.norm()).item()
        out[f"{key}_grad_w_rel"] = ((ww.grad.float() - w32.grad).norm() / w32.grad.norm()).item()
    return out


def build(shape: str, dtype: torch.dtype) -> Policy:
    """A random model of ``shape`` with tree attention, as the trainer's Policy, on the device."""
    from transformers import AutoModelForCausalLM

    register_tree_attention()
    torch.manual_seed(0)
    with torch.device(DEVICE):
        lm = AutoModelForCausalLM.from_config(qwen3_config(shape), attn_implementation=TREE_ATTENTION, dtype=dtype)
    return Policy(lm)


def set_mode(policy: Policy, compiled: bool, checkpointing: str, backend: str, chunk_size: int | None) -> None:
    """Unwrap the layers, then checkpoint and (optionally) compile them as the trainer does."""
    for layer in decoder_layers(policy):
        layer.__dict__.pop("forward", None)
    torch._dynamo.reset()
    apply_layer_wrappers(policy, checkpointing, "op", compiled, backend)
    policy.compile_head = compiled and DEVICE.type == "cuda"
    policy.chunk_size = chunk_size or (4096 if DEVICE.type == "cuda" else 1024)


def measure(policy: Policy, rows, budget: int, settings: LossSettings, flex) -> dict:
    """Rates and step-time spread of :func:`trainer.run_rows` over ``rows``."""
    r = run_rows(policy, rows, budget, flex, settings)
    s = r["seconds"]
    return {
        "rows": r["rows"],
        "forwarded_tokens_per_s": r["forwarded"] / s,
        "raw_tokens_per_s": r["raw"] / s,
        "trained_tokens_per_s": r["trained"] / s,
        "packing_ratio": r["raw"] / r["forwarded"],
        "pad_frac": 1 - r["forwarded"] / (budget * r["rows"]),
        **summarise(r["step_times_s"]),
        "step_times_s": r["step_times_s"],
    }


def sweep(args) -> list[dict]:
    """See module docs; returns one dict per (shape, mode, rows).

    Every shape runs compiled first, then eager (the reference), and a configuration
    that would start after ``--time-budget-s`` is reported as skipped, so the command
    ends in bounded time with the most wanted figures.
    """
    shapes, modes = args.shapes.split(","), args.modes.split(",")
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    settings = LossSettings(score_centering=args.topk > 0)
    flex = FlexTreeMasks(DEVICE) if DEVICE.type == "cuda" else None
    t_start = time.perf_counter()
    checks = [] if args.no_check else [head_check(4096 if "tiny" in shapes else 151936, 1024)]
    for c in checks:
        print(c, flush=True)
    results, policies = [], {}
    for mode in sorted(modes, key=lambda m: m != "compiled"):
        for shape in shapes:
            if time.perf_counter() - t_start > args.time_budget_s:
                results.append({"shape": shape, "mode": mode, "error": "skipped (--time-budget-s)"})
                continue
            if shape not in policies:
                policies[shape] = build(shape, dtype)
            results.extend(run_shape(args, shape, mode, policies[shape], settings, flex))
            print_table(results[-2:], COLUMNS)
    policies.clear()
    gc.collect()
    print_table(results, COLUMNS)
    write_json(args.out, "trainer_sweep.json", checks + results)
    return checks + results


def run_shape(args, shape: str, mode: str, policy: Policy, settings: LossSettings, flex) -> list[dict]:
    """Warm-up (compiles in compiled mode), then plain and tree rows of the workload, for one shape and mode."""
    n_params = sum(p.numel() for p in policy.parameters())
    emb, head = policy.base().get_input_embeddings().weight, policy.base().get_output_embeddings().weight
    vocab = head.shape[0]
    body_params = n_params - emb.numel() - (0 if head is emb else head.numel())  # tied: counted once in n_params
    lengths = dict(prompt_len=64, completion_len=(8, 64)) if shape == "tiny" else {}
    samples = workload(args.groups, args.group_size, vocab, topk=args.topk, **lengths)
    rows = {
        "plain": plain_rows(samples, args.budget)[: args.steps],
        "tree": tree_rows(samples, args.budget)[: args.steps],
    }
    ac = AUTO_CHECKPOINTING.get(shape, "none") if args.checkpointing == "auto" else args.checkpointing
    set_mode(policy, mode == "compiled", ac, args.compile_backend, args.chunk_size)
    base = {"shape": shape, "params_b": n_params / 1e9, "mode": mode, "checkpointing": ac}
    t0 = time.perf_counter()
    try:
        rt = synthetic_row(args.budget, args.budget - 1, vocab, DEVICE, args.topk)
        if flex is not None:
            rt.tree_mask = flex.build(rt.tree_mask.subtree_end, args.budget)
        step(policy, rt, settings)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return [{**base, "error": "oom in warm-up"}]
    base["warmup_s"] = time.perf_counter() - t0  # one warm-up (compile) serves both row kinds
    out = []
    for kind in ("plain", "tree"):
        r = {**base, "row_kind": kind}
        if DEVICE.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            r.update(measure(policy, rows[kind], args.budget, settings, flex))
        except torch.OutOfMemoryError:
            r["error"] = "oom"
            torch.cuda.empty_cache()
        if "error" not in r and DEVICE.type == "cuda":
            r["mfu"] = 6 * n_params * r["forwarded_tokens_per_s"] / H200_BF16_PEAK
            r["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out.append(r)
    tree_vs_plain(out, body_params, head.numel())
    return out


def tree_vs_plain(results: list[dict], body_params: int, head_params: int) -> None:
    """Tree forwarded tok/s ÷ plain forwarded tok/s of the last shape and mode (= tree raw tok/s ÷ (packing ratio ×
    plain raw tok/s); the goal is ≥ 0.9), and its matmul-FLOP ceiling (:func:`tree_flop_ceiling`)."""
    if len(results) >= 2 and results[-1].get("row_kind") == "tree" and results[-2].get("row_kind") == "plain":
        t, p = results[-1], results[-2]
        if "error" not in t and "error" not in p:
            t["tree_over_ratio_x_plain"] = t["forwarded_tokens_per_s"] / p["forwarded_tokens_per_s"]
            t["tree_flop_ceiling"] = tree_flop_ceiling(
                body_params,
                head_params,
                p["trained_tokens_per_s"] / p["forwarded_tokens_per_s"],
                t["trained_tokens_per_s"] / t["forwarded_tokens_per_s"],
            )


def tree_flop_ceiling(body_params: int, head_params: int, plain_trained_frac: float, tree_trained_frac: float) -> float:
    """The highest tree/(ratio·plain) that equal FLOP/s on both row kinds allow.

    Every forwarded token goes through the decoder layers (6 × ``body_params`` FLOPs forward and backward: the
    parameters outside the input embedding and the output head), but only trained tokens (loss positions) go
    through the vocabulary projection (6 × ``head_params``: ``V × H``). A tree row trains more of the tokens it
    forwards (``tree_trained_frac`` against ``plain_trained_frac``, trained ÷ forwarded tokens), so each of its
    forwarded tokens costs more: the ceiling is ``(body + head·f_plain) / (body + head·f_tree)``. Attention FLOPs
    are left out. Qwen3-0.6B (body 0.44B, head 151,936 × 1,024, f 0.36 vs 0.79) gives 0.88: a 0.9 goal there is
    above what the arithmetic allows, while the 4B shape's ceiling is 0.96.
    """
    body, head = float(body_params), float(head_params)
    return (body + head * plain_trained_frac) / (body + head * tree_trained_frac)


COLUMNS = [
    ("shape", "shape", ""),
    ("mode", "mode", ""),
    ("row_kind", "rows", ""),
    ("checkpointing", "ac", ""),
    ("rows", "n", ""),
    ("forwarded_tokens_per_s", "fwd tok/s", "{:,.0f}"),
    ("raw_tokens_per_s", "raw tok/s", "{:,.0f}"),
    ("trained_tokens_per_s", "trained tok/s", "{:,.0f}"),
    ("packing_ratio", "pack", "{:.2f}"),
    ("tree_over_ratio_x_plain", "tree/(ratio·plain)", "{:.2f}"),
    ("tree_flop_ceiling", "FLOP ceiling", "{:.2f}"),
    ("mfu", "MFU", "{:.1%}"),
    ("peak_mem_gib", "peak GiB", "{:.1f}"),
    ("warmup_s", "warm-up s", "{:.1f}"),
    ("median_step_s", "median s", "{:.3f}"),
    ("max_over_median", "max/med", "{:.2f}"),
    ("error", "error", ""),
]
