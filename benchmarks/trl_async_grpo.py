"""TRL's AsyncGRPOTrainer (trl 1.16.0) on the same GPU, model, task, reward, G, lengths, token budget and steps.

Reads a grpo-flow run config (``configs/gpu-1xh200.yaml`` by default) and gives TRL the same
model folder, prompts (the same reasoning-gym rows), reward functions, G, completion length,
sampling settings, learning rate, token budget and step count, against a real vLLM started with
grpo-flow's own flags (``provision``; served under the model folder's path, the name TRL asks
for). Prints and writes ``trl_summary.json``: wall-clock of the steps and trained tokens/s, and,
with ``--compare summary.json``, grpo-flow's figures of the same config beside them.

What TRL 1.16.0 needs that an offline host lacks (read from its source,
``trl/experimental/async_grpo``), and what this script does about it:

1. **Attention kernel from the Hub.** Its tree attention (``packing.py``, ``_flash_attn``)
   calls ``kernels.get_kernel("kernels-community/flash-attn3", version=1)``: the ``kernels``
   package downloads a compiled FlashAttention-3 from the Hugging Face Hub at the first forward.
   No Hub is reachable from the GPU host (nor from the machine that builds the wheelhouse), so
   TRL as shipped stops there. ``--attention torch-varlen`` (default) substitutes PyTorch's own
   variable-length flash attention (``torch.nn.attention.varlen.varlen_attn``, FA2 built into
   torch 2.11) behind the same ``flash_attn_varlen_func`` call; ``--attention hub`` keeps TRL's.
2. **Response template.** The rollout worker parses each completion with the tokenizer's response template,
   which ``add_response_schema`` knows only for the chat templates TRL lists; SmolLM2's ChatML one is not among
   them and the worker exits at start-up ("Unrecognized chat template", seen on the H200). ``trl_tokenizer``
   sets the ChatML form of TRL's own Qwen3 template (content only); ``--dry-run`` prints a parsed completion.
3. **NCCL-only weight sync.** ``WeightTransferClient`` streams weights over NCCL, which refuses
   two ranks on one GPU. On one GPU this script passes ``weight_transfer=`` (TRL's documented
   ``WeightTransferProtocol``) an IPC implementation: vLLM's ``IPCWeightTransferEngine`` framed
   by grpo-flow's ``ipc_update_body``, pause in keep mode. With ``--gpus 2`` TRL's own NCCL client
   is used (vLLM on GPU 0, TRL on GPU 1).
4. **No bearer token.** The rollout worker's ``aiohttp.ClientSession`` sends no headers, and grpo-flow's
   servers answer 401 without the run's token (every request failed on the H200). ``trl_sends_run_token``
   gives TRL's processes a ``sitecustomize`` whose aiohttp sessions send it (``--dry-run`` checks it).

Counting: TRL trains every group, also those whose rewards all tie (advantages 0, no gradient), while
grpo-flow drops them before its trainer; besides TRL's own trained tokens/s the report gives the tokens/s of
the samples TRL pulled with a non-zero advantage (``signal_tokens_per_s_*``) and the speed-up against each, both
over TRL's steady steps (``*_steady``), as grpo-flow's rates are; ``*_wall`` also counts TRL's start-up.

    python benchmarks/trl_async_grpo.py --config configs/gpu-1xh200.yaml --steps 30 --out $OUT \
        --compare $OUT/summary.json
    python benchmarks/trl_async_grpo.py --dry-run            # CPU: builds everything but the trainer; lists blockers
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from grpo_core.config import RunConfig, load_config  # noqa: E402
from grpo_core.models import resolve_model_dir  # noqa: E402
from grpo_core.security.auth import bearer_headers, ensure_run_token, run_token  # noqa: E402


def dataset_and_rewards(cfg: RunConfig):
    """The run's prompt rows (HF Dataset with ``prompt`` messages and the reward columns) and reward callables."""
    from datasets import Dataset

    from grpo_core.rollout.build import config_rewards
    from grpo_core.rollout.data import iter_rows, load_dataset

    rows = [
        {**r, "prompt": [{"role": "user", "content": r["prompt"]}] if isinstance(r["prompt"], str) else r["prompt"]}
        for r in iter_rows(load_dataset(cfg.rollout))
    ]
    return Dataset.from_list(rows), config_rewards(cfg.rollout)


class IpcWeightTransfer:
    """TRL's ``WeightTransferProtocol`` over vLLM's CUDA IPC engine (one GPU), pausing in keep mode."""

    def __init__(self, url: str):
        import httpx

        self.url, self.http = url, httpx.Client(timeout=600, headers=bearer_headers(run_token()))

    def _post(self, path: str, body: dict | None = None, params: dict | None = None) -> None:
        r = self.http.post(self.url + path, json=body, params=params)
        r.raise_for_status()

    def init_weight_transfer(self) -> None:
        """Once: the IPC engine needs no group."""
        self._post("/init_weight_transfer_engine", {"init_info": {}})

    def pause(self) -> None:
        """Freeze in-flight requests (keep mode)."""
        self._post("/pause", params={"mode": "keep"})

    def send_weights(self, iterator) -> None:
        """start → IPC handles posted to /update_weights → finish → prefix-cache reset."""
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

        from grpo_core.train.weight_sync.vllm import ipc_update_body

        self._post("/start_weight_update", {"is_checkpoint_format": True})
        try:
            IPCWeightTransferEngine.trainer_send_weights(
                ((n, t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in iterator),
                {"send_mode": lambda info: self._post("/update_weights", ipc_update_body(info))},
            )
        finally:
            self._post("/finish_weight_update")
            self._post("/reset_prefix_cache", params={"reset_running_requests": "true"})

    def resume(self) -> None:
        """Continue generation."""
        self._post("/resume")

    def destroy(self) -> None:
        """Nothing to release."""


def torch_varlen_attention():
    """An object with FlashAttention's ``flash_attn_varlen_func`` signature, on PyTorch's built-in varlen kernel."""
    import types

    import torch
    from torch.nn.attention.varlen import varlen_attn

    def flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False, window_size=(-1, -1), **_
    ):
        left = window_size[0]
        window = (left, 0) if causal else (left, window_size[1])
        return varlen_attn(
            q,
            k,
            v,
            cu_q.to(torch.int32),
            cu_k.to(torch.int32),
            int(max_q),
            int(max_k),
            scale=softmax_scale,
            window_size=window,
        )

    return types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)


def trl_args(cfg: RunConfig, url: str, steps: int, out: Path):
    """``AsyncGRPOConfig`` with the grpo-flow run's settings."""
    from trl.experimental.async_grpo import AsyncGRPOConfig

    r, t = cfg.rollout, cfg.train
    return AsyncGRPOConfig(
        output_dir=str(out / "trl"),
        max_steps=steps,
        learning_rate=t.learning_rate,
        num_generations=r.num_generations,
        max_completion_length=r.max_completion_length,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        min_p=r.min_p or None,
        token_budget=cfg.token_budget(),
        max_staleness=r.max_staleness,
        weight_sync_steps=t.weight_sync_steps,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        vllm_server_base_url=url,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=torch_cuda(),
        use_cpu=not torch_cuda(),
        gradient_checkpointing=t.gradient_checkpointing != "none",
        max_grad_norm=t.max_grad_norm,
        seed=t.seed,
    )


# TRL's rollout worker parses every completion with the tokenizer's response template and knows only the chat
# templates of the models it lists (trl/chat_template_utils.py:add_response_schema); SmolLM2 ships a plain ChatML
# template that is not among them. This is the ChatML form of TRL's own Qwen3 template, content only (no tools).
CHATML_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {"content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"}},
}


def trl_tokenizer(model_dir: Path):
    """The tokenizer TRL's rollout worker gets: TRL's own response template where it knows the chat template, else
    the ChatML one above when the template is ChatML.

    Raises:
        ValueError: a chat template that is neither known to TRL nor ChatML (TRL could not parse completions).
    """
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    try:
        return add_response_schema(tokenizer)
    except ValueError:
        if "<|im_start|>" not in (tokenizer.chat_template or ""):
            raise
    tokenizer.response_template = CHATML_RESPONSE_TEMPLATE
    return tokenizer


def parse_like_trl(tokenizer) -> dict:
    """What TRL's rollout worker makes of a one-turn completion ``"42<|im_end|>"`` (its ``parse_response`` with the
    prompt as prefix, async_rollout_worker.py): ``{"role": "assistant", "content": "42"}`` when the template fits."""
    from trl.chat_template_utils import parse_response

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "6 times 7?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    completion = tokenizer.encode("42", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return parse_response(tokenizer, completion, prefix=list(prompt))


def torch_cuda() -> bool:
    """Whether a CUDA device is visible (bf16 mixed precision as grpo-flow's trainer uses on CUDA)."""
    import torch

    return torch.cuda.is_available()


def blockers(gpus: int, attention: str) -> list[str]:
    """What stops TRL 1.16.0 here, as found in its source (see the module docstring)."""
    found = [
        "tree attention fetches kernels-community/flash-attn3 from the Hugging Face Hub at the first forward "
        "(trl/experimental/async_grpo/packing.py:_flash_attn -> kernels.get_kernel): no Hub is reachable"
        + ("" if importlib.util.find_spec("kernels") else "; the 'kernels' package is not installed either")
        + ("" if attention == "hub" else "; replaced by torch.nn.attention.varlen.varlen_attn (FA2 in torch)")
    ]
    found.append(
        "the rollout worker parses completions with a response template it has only for the chat templates it "
        "lists (chat_template_utils.py:add_response_schema); SmolLM2's ChatML template is not one: "
        "trl_tokenizer() sets the ChatML form of TRL's Qwen3 template"
    )
    if gpus == 1:
        found.append(
            "default weight sync is NCCL (weight_transfer.py:WeightTransferClient), which refuses vLLM and "
            "the trainer on one GPU: replaced by IpcWeightTransfer (WeightTransferProtocol)"
        )
    found.append(
        "the rollout worker's aiohttp session sends no Authorization header (async_rollout_worker.py), "
        "and grpo-flow's servers require the run's bearer token (401 on every request): "
        "trl_sends_run_token() gives TRL's processes a sitecustomize that adds it"
    )
    if importlib.util.find_spec("vllm") is None:
        found.append(
            "vllm is not importable: TRL's weight transfer and this script's IPC sync need it (the vLLM bundle)"
        )
    return found


#: ``sitecustomize`` for TRL's processes (the trainer and its spawned rollout worker): every aiohttp session sends
#: the run's bearer token, which grpo-flow's servers require (``grpo_core.serving.guard``) and TRL's worker, whose
#: ``aiohttp.ClientSession`` has no headers (async_rollout_worker.py), does not send: every request answered 401.
_SEND_TOKEN = """
import os
_token = os.environ.get("GRPO_RUN_TOKEN")
if _token:
    import aiohttp
    _init = aiohttp.ClientSession.__init__

    def _with_token(self, *args, headers=None, **kwargs):
        _init(self, *args, headers={"Authorization": "Bearer " + _token, **dict(headers or {})}, **kwargs)

    aiohttp.ClientSession.__init__ = _with_token
"""


def trl_sends_run_token(folder: Path) -> dict[str, str]:
    """Write the ``sitecustomize`` above to ``folder``; returns the environment that makes every process started
    with it (``PYTHONPATH`` first) send the run's token from its aiohttp sessions; this process too from now."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_SEND_TOKEN)
    exec(compile(_SEND_TOKEN, str(folder / "sitecustomize.py"), "exec"), {})  # this process (spawn children: env)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


def check_sends_run_token(env: dict[str, str]) -> bool:
    """Whether a fresh interpreter with ``env`` gives a new aiohttp session the run's bearer header."""
    import subprocess

    code = (
        "import asyncio, aiohttp, os\n"
        "async def main():\n"
        "    async with aiohttp.ClientSession() as s:\n"
        "        print(s.headers.get('Authorization') == 'Bearer ' + os.environ['GRPO_RUN_TOKEN'])\n"
        "asyncio.run(main())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    return out.stdout.strip() == "True"


#: Completion tokens of the samples TRL's trainer took from its rollout queue, by whether their advantage is 0.
#: TRL trains every group, also one whose rewards all tie (every advantage 0: no gradient); grpo-flow drops such
#: groups before the trainer (``frac_reward_zero_std``), so its trained tokens all carry a learning signal. The
#: comparison reports both counts of TRL's.
PULLED = {"signal": 0, "zero_advantage": 0}


def count_pulled_tokens(dataset_class: type) -> None:
    """Wrap ``RolloutQueueDataset.__iter__`` (trl/experimental/async_grpo) to add each sample's completion tokens
    (``sum(completion_mask)``) to :data:`PULLED`, under ``zero_advantage`` when its advantage is 0."""
    original = dataset_class.__iter__

    def counting(self):
        for item in original(self):
            PULLED["zero_advantage" if float(item["advantage"]) == 0.0 else "signal"] += int(
                sum(item["completion_mask"])
            )
            yield item

    dataset_class.__iter__ = counting


def check_counts_pulled_tokens() -> bool:
    """CPU check of :func:`count_pulled_tokens` on TRL's own dataset class, fed two samples through its queue."""
    import queue
    from types import SimpleNamespace

    from trl.experimental.async_grpo.async_grpo_trainer import RolloutQueueDataset

    count_pulled_tokens(RolloutQueueDataset)
    q: queue.Queue = queue.Queue()
    for advantage, mask in ((0.0, [0, 1, 1]), (0.7, [0, 0, 1, 1, 1])):
        q.put(
            SimpleNamespace(
                input_ids=[1] * len(mask),
                completion_mask=mask,
                old_log_probs=[0.0] * len(mask),
                advantage=advantage,
                group_id=0,
                metrics={},
                model_version=0,
                enqueued_at=None,
            )
        )
    before = dict(PULLED)
    it = iter(
        RolloutQueueDataset(
            q,
            lambda: 0,
            lambda s: None,
            60,
            {"sample/rollout_queue_size": [], "sample/staleness_mean": [], "sample/staleness_max": []},
            max_staleness=1,
        )
    )
    next(it), next(it)
    return (PULLED["zero_advantage"] - before["zero_advantage"], PULLED["signal"] - before["signal"]) == (2, 3)


def summarize(history: list[dict], wall_s: float, steps: int, warmup_steps: int = 3) -> dict:
    """Trained tokens/s of TRL's steps from its own log history, and of the samples it pulled with a non-zero
    advantage (:data:`PULLED`): over the whole ``trainer.train()`` wall clock (``*_wall``: TRL's model load and
    worker start-up included) and over its steady steps (``*_steady``: the steps after ``warmup_steps``, the
    same rule as ``benchmarks/gpu_e2e.py``, whose rates are steady ones: compare those)."""
    logs = [h for h in history if "perf/step_s" in h]
    trained = sum(h.get("batch/trained_tokens_per_step", 0.0) for h in logs)
    steady = logs[warmup_steps:] or logs
    steady_s = sum(h["perf/step_s"] for h in steady)
    steady_rate = sum(h.get("batch/trained_tokens_per_step", 0.0) for h in steady) / steady_s if steady_s else 0.0
    pulled = PULLED["signal"] + PULLED["zero_advantage"]
    zero_frac = PULLED["zero_advantage"] / pulled if pulled else None
    return {
        "steps": steps,
        "wall_s": round(wall_s, 1),
        "trained_tokens_per_s_wall": trained / wall_s if wall_s else 0,
        "trained_tokens_per_s_steady": steady_rate,
        "pulled_zero_advantage_token_frac": zero_frac,
        "signal_tokens_per_s_wall": PULLED["signal"] / wall_s if wall_s else 0,
        "signal_tokens_per_s_steady": steady_rate * (1 - zero_frac) if zero_frac is not None else None,
        "step_s_median": statistics.median([h["perf/step_s"] for h in logs]) if logs else None,
        "trl_trained_tok_s_wall_clock": statistics.fmean(
            [h["perf/trained_tok_s_wall_clock"] for h in logs if "perf/trained_tok_s_wall_clock" in h] or [0.0]
        ),
        "reward": [h.get("reward") for h in logs],
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "gpu-1xh200.yaml"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--gpus", type=int, choices=[1, 2], default=1)
    p.add_argument("--attention", choices=["torch-varlen", "hub"], default="torch-varlen")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/trl")))
    p.add_argument("--compare", type=Path, default=None, help="grpo-flow's summary.json (benchmarks/gpu_e2e.py)")
    p.add_argument("--dry-run", action="store_true", help="CPU: build data, rewards and TRL's config; list blockers")
    args = p.parse_args(argv)
    overrides = ["server.port=0", f"server.log_dir={ROOT / 'runs' / 'trl' / 'servers'}"]
    if args.gpus == 2:
        overrides += ["server.gpu_ids=[0]", "train.gpu_ids=[1]", "server.weight_transfer_backend=nccl"]
    cfg = load_config(args.config, overrides)
    model_dir = resolve_model_dir(cfg.model)
    cfg.server.served_model_name = str(model_dir)  # TRL's rollout worker asks for the model by its path
    dataset, rewards = dataset_and_rewards(cfg)
    found = blockers(args.gpus, args.attention)
    report = {
        "trl": __import__("trl").__version__,
        "blockers": found,
        "prompts": len(dataset),
        "rewards": [f.__name__ for f in rewards],
        "config": args.config,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        report["trl_config"] = {
            k: v
            for k, v in vars(trl_args(cfg, "http://127.0.0.1:8000", args.steps, args.out)).items()
            if k
            in (
                "num_generations",
                "max_completion_length",
                "temperature",
                "top_k",
                "token_budget",
                "max_steps",
                "learning_rate",
                "max_staleness",
            )
        }
        tokenizer = trl_tokenizer(model_dir)
        report["tokenizer_eos"] = tokenizer.eos_token
        report["parsed_completion"] = parse_like_trl(tokenizer)
        ensure_run_token()
        report["trl_sends_run_token"] = check_sends_run_token(trl_sends_run_token(args.out / "trl_site"))
        report["trl_pulled_tokens_counted"] = check_counts_pulled_tokens()
        print(json.dumps(report, indent=1))
        return 0
    if args.gpus == 2:
        os.environ["CUDA_VISIBLE_DEVICES"] = "1"  # TRL's process; vLLM gets GPU 0 through its own environment
    from grpo_core.serving.launch import provision, teardown

    handles = provision(cfg)
    try:
        os.environ.update(trl_sends_run_token(args.out / "trl_site"))  # after vLLM started: TRL's processes only
        from trl.experimental.async_grpo import AsyncGRPOTrainer, packing

        if args.attention == "torch-varlen":
            packing._flash_attn = torch_varlen_attention
        from trl.experimental.async_grpo.async_grpo_trainer import RolloutQueueDataset

        count_pulled_tokens(RolloutQueueDataset)
        trainer = AsyncGRPOTrainer(
            model=str(model_dir),
            reward_funcs=rewards,
            train_dataset=dataset,
            processing_class=trl_tokenizer(model_dir),
            args=trl_args(cfg, handles[0].url, args.steps, args.out),
            weight_transfer=IpcWeightTransfer(handles[0].url) if args.gpus == 1 else None,
        )
        start = time.monotonic()
        trainer.train()
        report.update(summarize(trainer.state.log_history, time.monotonic() - start, args.steps))
    finally:
        teardown(handles)
    if args.compare and args.compare.exists():
        runs = json.loads(args.compare.read_text())
        # gpu_e2e's run of this config (configs/gpu-1xh200.yaml -> "1xh200"), else its only run
        ours = runs.get(Path(args.config).stem.removeprefix("gpu-")) or (
            next(iter(runs.values())) if len(runs) == 1 else {}
        )
        report["grpo_flow"] = {k: ours.get(k) for k in ("run", "wall_s", "trained_tokens_per_s", "step_s_median")}
        # steady against steady (gpu_e2e's rates leave out its warm-up steps); grpo-flow trains only groups whose
        # rewards differ, so also against TRL's tokens that carry a learning signal; None where a side has no rate
        rate = ours.get("trained_tokens_per_s")
        for key, theirs in (
            ("speedup_trained_tokens_per_s", report["trained_tokens_per_s_steady"]),
            ("speedup_signal_tokens_per_s", report["signal_tokens_per_s_steady"]),
        ):
            report[key] = rate / theirs if rate and theirs else None
    (args.out / "trl_summary.json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({k: v for k, v in report.items() if k != "reward"}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
