"""The trained policy: a causal LM behind one FSDP2 root module whose forward
returns the trained tokens' log-probs of a packed row.

Wrapping (torchtitan's order, :mod:`grpo_core.train.parallelize`): activation
checkpointing, compilation, then ``fully_shard`` on every decoder layer and on the
root. Calling the decoder and the output projection inside the root's ``forward``
lets FSDP2 gather the root-level parameters (embeddings, final norm, lm_head)
around them.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from grpo_core.config import LoraConfig, ModelConfig
from grpo_core.errors import ConfigError
from grpo_core.models.text_model import load_text_model, text_decoder

from .attention import TREE_ATTENTION, TreeMask, dense_tree_mask, register_tree_attention
from .logprobs import HeadLoss, LossTerms, TokenLogProbs, candidate_mask, fused_grpo_loss, projected_logprobs
from .loss import LossSettings
from .moe import MoeRouting, load_balancing_loss, moe_routing, records_router_logits, resolve_router_aux_loss_coef
from .packable import check_packable
from .recurrent import install_tree_recurrence

if TYPE_CHECKING:
    from .rows import RowTensors


logger = logging.getLogger(__name__)


@dataclass
class LossInputs:
    """What the fused head needs besides the row to compute the GRPO loss (see :func:`fused_grpo_loss`).

    Attributes:
        sampler_logprobs, advantages: ``float32[M]``.
        sampler_topk_logprobs: ``float32[M, k]`` or None.
        normaliser: the loss's divisor (``grpo_core.train.loss.loss_normalisers``).
        settings: :class:`LossSettings`.
        sample_index: ``int64[M]`` the sample of each term in its row (GSPO's sequences), or None.
        ref_logprobs: ``float32[M]`` the reference policy's log-probs of the targets (``train.kl_coef``), or None.
        aux_weight: weight of the row's router load-balancing loss in its loss (a mixture-of-experts policy with
            ``train.router_aux_loss_coef`` > 0: the coefficient ÷ the step's micro-batches); 0 = not computed.
        num_tokens: the row's forwarded tokens (the positions after them are padding); None = every position.
    """

    sampler_logprobs: Tensor
    advantages: Tensor
    sampler_topk_logprobs: Tensor | None
    normaliser: float
    settings: LossSettings
    sample_index: Tensor | None = None
    ref_logprobs: Tensor | None = None
    aux_weight: float = 0.0
    num_tokens: int | None = None


class Policy(nn.Module):
    """Root module: packed row in, :class:`TokenLogProbs` (or the fused head's loss) out.

    Args:
        lm: a transformers causal LM (optionally PEFT-wrapped) using ``grpo_tree`` attention.
        temperature: sampler temperature applied to the logits.
        chunk_size: loss terms per chunk of the vocabulary projection.
        compile_head: run the fused head's elementwise stages through ``torch.compile``.
        fp32_logits: keep the head's logits in fp32 (``train.fp32_logits``; see :func:`head_logits`).

    Attributes:
        router: a mixture-of-experts model's routing (:func:`~grpo_core.train.moe.moe_routing`), or None (dense).
        router_aux_loss_coef: weight of the routers' load-balancing loss (``train.router_aux_loss_coef`` resolved
            by :func:`~grpo_core.train.moe.resolve_router_aux_loss_coef`); 0 = off.
    """

    def __init__(
        self,
        lm: nn.Module,
        temperature: float = 1.0,
        chunk_size: int = 1024,
        compile_head: bool = False,
        fp32_logits: bool = False,
    ):
        super().__init__()
        self.lm = lm
        self.temperature = temperature if temperature > 0 else 1.0
        self.chunk_size = chunk_size
        self.compile_head = compile_head
        self.fp32_logits = fp32_logits
        self.router: MoeRouting | None = None
        self.router_aux_loss_coef = 0.0

    def base(self) -> nn.Module:
        """The underlying transformers model (PEFT wrapper removed)."""
        return self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        tree_mask: TreeMask,
        token_index: Tensor,
        targets: Tensor,
        topk_ids: Tensor | None = None,
        candidates: tuple[Tensor, Tensor] | None = None,
        loss: LossInputs | None = None,
    ) -> tuple[Tensor, ...] | dict[str, Tensor]:
        """See :func:`row_logprobs`; shapes in ``RowTensors``.

        Returns plain containers so that FSDP2 sees the output tensors (for its
        pre-backward hooks): without ``loss`` the tuple ``(logprobs, entropy[, topk_logprobs])``
        (:meth:`logprobs` wraps it); with ``loss`` the fused head's dict ``loss``,
        ``logprobs``, ``entropy``, [``topk_logprobs``] and :func:`grpo_loss`'s statistics
        (:meth:`grpo_loss` wraps it). With ``loss.aux_weight`` > 0 (a mixture-of-experts policy) the dict's ``loss``
        adds ``aux_weight`` × the row's router load-balancing loss (:func:`~grpo_core.train.moe.load_balancing_loss`
        over its ``loss.num_tokens`` forwarded tokens), logged as ``aux_loss`` before the weight.
        """
        base = self.base()
        tree_mask.check_current()
        if tree_mask.dense is None and tree_mask.block_mask is None:
            tree_mask = TreeMask(
                tree_mask.subtree_end, dense=dense_tree_mask(tree_mask.subtree_end), recurrence=tree_mask.recurrence
            )
        aux = loss is not None and loss.aux_weight > 0 and self.router is not None
        out = text_decoder(base)(
            input_ids=input_ids[None],
            position_ids=position_ids[None],
            tree_mask=tree_mask,
            use_cache=False,
            **({"output_router_logits": True} if aux else {}),
        )
        hidden = out.last_hidden_state[0]
        weight = base.get_output_embeddings().weight
        if loss is not None:
            terms = LossTerms(
                targets,
                loss.sampler_logprobs,
                loss.advantages,
                topk_ids,
                loss.sampler_topk_logprobs,
                candidates,
                sequence_index=loss.sample_index,
                ref_logprobs=loss.ref_logprobs,
            )
            res = fused_grpo_loss(
                hidden.index_select(0, token_index),
                weight,
                terms,
                loss.normaliser,
                loss.settings,
                self.temperature,
                self.chunk_size,
                self.compile_head,
                self.fp32_logits,
            )
            total = res.loss
            extra = {}
            if aux:
                assert self.router is not None and loss is not None
                num_tokens = input_ids.shape[0] if loss.num_tokens is None else loss.num_tokens
                aux_loss = load_balancing_loss(
                    out.router_logits, self.router.num_experts, self.router.top_k, num_tokens
                )
                total = total + loss.aux_weight * aux_loss
                extra["aux_loss"] = aux_loss.detach()
            return {
                "loss": total,
                **extra,
                "logprobs": res.logprobs.logprobs,
                "entropy": res.logprobs.entropy,
                **({} if res.logprobs.topk_logprobs is None else {"topk_logprobs": res.logprobs.topk_logprobs}),
                **res.stats,
            }
        dense_candidates = None
        if candidates is not None:
            dense_candidates = candidate_mask(candidates[0], candidates[1], weight.shape[0])
        picked = hidden.index_select(0, token_index)
        if picked.shape[0] == 0:  # a dummy row: keep every parameter in the graph
            zero = hidden.sum() * 0.0 + weight.sum() * 0.0
            empty = zero.reshape(1)[:0]
            return (empty, empty.detach()) + (() if topk_ids is None else (empty.reshape(0, topk_ids.shape[1]),))
        out = projected_logprobs(
            picked, weight, targets, self.temperature, topk_ids, dense_candidates, self.chunk_size, self.fp32_logits
        )
        return (out.logprobs, out.entropy) + (() if out.topk_logprobs is None else (out.topk_logprobs,))

    def adapter_disabled(self) -> contextlib.AbstractContextManager:
        """A context in which the forward runs without the LoRA adapter: the base model, the KL reference of a LoRA
        run at no memory cost (PEFT's ``disable_adapter``).

        Raises:
            ValueError: the policy has no adapter.
        """
        disable = getattr(self.lm, "disable_adapter", None)
        if disable is None:
            raise ValueError("the policy has no LoRA adapter to disable (train.lora.enabled is false)")
        return disable()

    def logprobs(self, rt: RowTensors) -> TokenLogProbs:
        """Forward one :class:`~grpo_core.train.rows.RowTensors` row."""
        return _as_logprobs(
            self(rt.input_ids, rt.position_ids, rt.tree_mask, rt.token_index, rt.target_id, rt.topk_ids, rt.candidates)
        )

    def grpo_loss(
        self,
        rt: RowTensors,
        settings: LossSettings,
        normaliser: float,
        ref_logprobs: Tensor | None = None,
        aux_scale: float = 1.0,
    ) -> HeadLoss:
        """Forward one row through the fused head: its GRPO loss (backward-ready) and per-term values.

        Args:
            rt: a :class:`~grpo_core.train.rows.RowTensors` row.
            settings: the loss settings.
            normaliser: see :func:`grpo_core.train.loss.grpo_loss`.
            ref_logprobs: ``float32[M]`` the reference policy's log-probs of the row's targets
                (``settings.kl_coef`` > 0; :meth:`reference_logprobs`), or None.
            aux_scale: the router load-balancing loss's weight is ``router_aux_loss_coef × aux_scale``
                (1 ÷ the step's micro-batches in training); its unweighted value is ``stats["aux_loss"]``.
        """
        out = self(
            rt.input_ids,
            rt.position_ids,
            rt.tree_mask,
            rt.token_index,
            rt.target_id,
            rt.topk_ids,
            rt.candidates,
            LossInputs(
                rt.sampler_logprob,
                rt.advantage,
                rt.topk_logprobs,
                normaliser,
                settings,
                rt.sample_index,
                ref_logprobs,
                self.router_aux_loss_coef * aux_scale,
                rt.num_forwarded,
            ),
        )
        token = TokenLogProbs(out.pop("logprobs"), out.pop("entropy"), out.pop("topk_logprobs", None))
        return HeadLoss(out.pop("loss"), token, out)


def row_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    position_ids: Tensor,
    tree_mask: TreeMask,
    token_index: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    topk_ids: Tensor | None = None,
    candidates: tuple[Tensor, Tensor] | None = None,
    chunk_size: int = 1024,
) -> TokenLogProbs:
    """Forward one packed row through a causal LM exactly as the trainer does (see :class:`Policy`).

    Args:
        model: a transformers causal LM loaded with ``attn_implementation="grpo_tree"``.
        input_ids, position_ids: ``int64[L]`` (padded row; positions = depth).
        tree_mask: the row's mask, length ``L``.
        token_index: ``int64[M]`` packed position predicting each trained token.
        targets: ``int64[M]``.
        temperature: sampler temperature.
        topk_ids: optional ``int64[M, k]`` sampler top-k ids (``-1`` padding).
        candidates: optional CSR sampling mask ``(offsets[M+1], ids)``.
        chunk_size: loss terms per chunk of the vocabulary projection.
    """
    return _as_logprobs(
        Policy(model, temperature, chunk_size)(
            input_ids, position_ids, tree_mask, token_index, targets, topk_ids, candidates
        )
    )


def _as_logprobs(out: tuple[Tensor, ...]) -> TokenLogProbs:
    return TokenLogProbs(out[0], out[1], out[2] if len(out) > 2 else None)


def build_policy(
    model_dir: str,
    model_cfg: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    lora: LoraConfig,
    temperature: float,
    chunk_size: int,
    max_len: int | None = None,
    fp32_logits: bool = False,
    router_aux_loss_coef: float | None = None,
) -> Policy:
    """Load the LM (a VLM's language model, ``grpo_core.models.text_model``) with tree attention and tree
    recurrence, optionally add LoRA, and wrap it in :class:`Policy` (unsharded; checkpointing,
    compilation and sharding come after, :mod:`grpo_core.train.parallelize`).

    Args:
        max_len: longest sequence of a packed row in tokens (for the packability check of windowed
            attention); None = the model's ``max_position_embeddings``.
        router_aux_loss_coef: ``train.router_aux_loss_coef`` (None = the model config's value; see
            :func:`~grpo_core.train.moe.resolve_router_aux_loss_coef`).

    Raises:
        ConfigError: a layer of the model cannot run on packed tree rows (``grpo_core.train.packable``), or a
            nonzero ``router_aux_loss_coef`` for a dense model or one whose decoder records no router logits.
    """
    register_tree_attention()
    lm = load_text_model(model_dir, dtype=dtype, attn_implementation=TREE_ATTENTION)
    text_cfg = lm.config.get_text_config()
    check_packable(lm, model_cfg.name, max_len or getattr(text_cfg, "max_position_embeddings", 1 << 20))
    aux_coef = resolve_router_aux_loss_coef(router_aux_loss_coef, lm.config, model_cfg.name)
    if aux_coef > 0 and not records_router_logits(text_decoder(lm)):
        raise ConfigError(
            f"model.name={model_cfg.name!r}: its decoder ({type(text_decoder(lm)).__name__}) does not return its "
            "router logits, so train.router_aux_loss_coef cannot be applied; set train.router_aux_loss_coef: 0"
        )
    num_recurrent = install_tree_recurrence(lm)
    lm.config.use_cache = False
    if lora.enabled:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        lm = get_peft_model(
            lm,
            PeftLoraConfig(
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=lora.target_modules,
                task_type="CAUSAL_LM",
            ),
        )
    turned_off = disable_dropout(lm)
    if turned_off:
        logger.warning(
            "dropout turned off in the trainer's forward (its log-probs must be the sampler's, DESIGN.md §5): %s",
            ", ".join(turned_off),
        )
    policy = Policy(lm, temperature, chunk_size, fp32_logits=fp32_logits).to(device)
    policy.router, policy.router_aux_loss_coef = moe_routing(lm.config), aux_coef
    n_train = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    logger.info(
        "policy %s: %.1fM trainable parameters (%s, lora=%s, %d Gated DeltaNet layers on tree rows)",
        model_cfg.name,
        n_train / 1e6,
        dtype,
        lora.enabled,
        num_recurrent,
    )
    return policy


def disable_dropout(model: nn.Module) -> list[str]:
    """Turn off every stochastic layer of ``model``'s forward, whatever its config or adapter settings say.

    The trainer's log-probs must be the sampler's distribution (DESIGN.md §5): a dropout active in the loss
    forward makes ``π/μ ≠ 1`` at staleness 0 and masked importance sampling cut tokens at random. Gradients
    are untouched (no ``torch.no_grad``, no ``eval()`` of the whole model, whose ``training`` flag other layers
    may read). Turned off:

    * every ``nn.Dropout``-like module (``torch.nn.modules.dropout._DropoutNd``: PEFT's ``lora_dropout``,
      a model's dropout layers): ``p = 0`` and put in eval mode;
    * every float attribute of a module or of the model's configs (the config, its text and vision
      sub-configs, PEFT's adapter configs) whose name contains ``dropout`` (``attention_dropout``
      read as ``dropout_p`` by the attention functions, ``hidden_dropout``, ``lora_dropout``, …): set to 0.

    Args:
        model: a transformers model, possibly PEFT-wrapped; changed in place.

    Returns:
        What was on before, e.g. ``["config.attention_dropout=0.5", "lora_dropout modules (p=0.5) x4"]``;
        empty when nothing was.
    """
    turned_off: list[str] = []
    for where, obj in _dropout_holders(model):
        for key, value in list(vars(obj).items()):
            if "dropout" in key and isinstance(value, float | int) and not isinstance(value, bool) and value > 0:
                setattr(obj, key, 0.0)
                if where:
                    turned_off.append(f"{where}.{key}={value}")
    modules: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):  # noqa: SLF001 - the base of every dropout module
            if module.p > 0:
                kind = "lora_dropout" if ".lora_dropout." in f".{name}." else type(module).__name__
                label = f"{kind} modules (p={module.p})"
                modules[label] = modules.get(label, 0) + 1
            module.p = 0.0
            module.eval()
    turned_off += [f"{label} x{count}" for label, count in modules.items()]
    return turned_off


def _dropout_holders(model: nn.Module) -> list[tuple[str, object]]:
    """The objects whose ``*dropout*`` floats a forward may read: configs (named) and modules (unnamed: many)."""
    holders: list[tuple[str, object]] = []
    config = getattr(model, "config", None)
    seen: set[int] = set()
    configs = [("config", config)] if config is not None else []
    while configs:
        name, cfg = configs.pop()
        if id(cfg) in seen:
            continue
        seen.add(id(cfg))
        holders.append((name, cfg))
        configs += [
            (f"{name}.{k}", v) for k, v in vars(cfg).items() if hasattr(v, "to_dict") and hasattr(v, "model_type")
        ]
    for adapter, cfg in (getattr(model, "peft_config", None) or {}).items():
        holders.append((f"peft_config[{adapter!r}]", cfg))
    holders += [("", module) for module in model.modules()]
    return holders
