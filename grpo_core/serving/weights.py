"""Weight changes of the embedded server: full weights from disk in place, LoRA adapters via PEFT.

Both run between decode steps (``Engine.exclusive``). Full-weight updates read a
checkpoint-format folder (``*.safetensors`` as written by ``save_pretrained``, one file or
shards) and copy each tensor into the live parameter of the same name, so running
sequences continue on the new weights, as on vLLM. Names may carry PEFT's ``.base_layer``
segment or ``base_model.model.`` prefix (vLLM with ``--enable-lora`` needs the same mapping);
they are mapped back to the base model's names.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from grpo_core.errors import ServingError
from grpo_core.serving.engine import Engine

logger = logging.getLogger(__name__)


class AdapterError(ServingError, ValueError):
    """A LoRA adapter request names an unknown adapter, a duplicate, or an unreadable folder."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def canonical_name(name: str) -> str:
    """Map a PEFT-wrapped parameter name to the base model's name."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


class WeightManager:
    """Owns the base model's parameters and the PEFT wrapper of the embedded server.

    Args:
        engine: the decode engine whose model is updated.
        max_lora_rank: largest adapter rank accepted (as vLLM's ``--max-lora-rank``).
    """

    def __init__(self, engine: Engine, max_lora_rank: int = 512) -> None:
        self.engine = engine
        self.base = engine.model
        self.max_lora_rank = max_lora_rank
        self.params: dict[str, torch.Tensor] = dict(self.base.state_dict(keep_vars=True))
        self.adapters: dict[str, str] = {}
        self.peft: Any = None

    def load_full_weights(self, path: str | Path) -> int:
        """Copy every tensor of the safetensors files in ``path`` into the model, in place.

        All tensors are read and checked (names, shapes) before any parameter changes.

        Returns:
            Number of tensors copied.

        Raises:
            ServingError: the folder has no safetensors files, or a name/shape does not match.
        """
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise ServingError(f"no *.safetensors files in {path}")
        incoming: dict[str, torch.Tensor] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    incoming[canonical_name(key)] = f.get_tensor(key)
        unknown = sorted(set(incoming) - set(self.params))
        if unknown:
            raise ServingError(f"{len(unknown)} tensors in {path} match no model parameter, e.g. {unknown[:3]}")
        bad = [n for n, t in incoming.items() if t.shape != self.params[n].shape]
        if bad:
            raise ServingError(f"shape mismatch for {bad[:3]}: e.g. {tuple(incoming[bad[0]].shape)} vs "
                               f"{tuple(self.params[bad[0]].shape)}")
        with self.engine.exclusive(), torch.no_grad():
            for name, tensor in incoming.items():
                self.params[name].copy_(tensor)
        logger.info("loaded %d tensors from %s in place", len(incoming), path)
        return len(incoming)

    def load_adapter(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter from ``path`` and serve it as model ``name``.

        Raises:
            AdapterError: duplicate name (400), missing folder (404), rank above the limit (400).
        """
        from peft import LoraConfig, PeftModel

        if name in self.adapters:
            raise AdapterError(f"The lora adapter '{name}' has already been loaded.", 400)
        if not (Path(path) / "adapter_config.json").is_file():
            raise AdapterError(f"No adapter found for {path}: adapter_config.json is missing.", 404)
        rank = LoraConfig.from_pretrained(path).r
        if rank > self.max_lora_rank:
            raise AdapterError(f"LoRA rank {rank} is greater than max_lora_rank {self.max_lora_rank}.", 400)
        with self.engine.exclusive():
            if self.peft is None:
                self.peft = PeftModel.from_pretrained(self.base, path, adapter_name=name, is_trainable=False)
                self.peft.eval()
                self.engine.model = self.peft
                self.engine.use_adapters = True
            else:
                self.peft.load_adapter(path, adapter_name=name, is_trainable=False)
                if not self.adapters:  # the wrapper was bypassed after its last adapter left
                    self.peft.set_adapter(name)
                    self.engine.model, self.engine.use_adapters = self.peft, True
            self.adapters[name] = path
        logger.info("loaded LoRA adapter %s (r=%d) from %s", name, rank, path)

    def unload_adapter(self, name: str) -> None:
        """Remove adapter ``name``; requests naming it get 404 afterwards.

        Raises:
            AdapterError: the adapter is not loaded (404).
        """
        if name not in self.adapters:
            raise AdapterError(f"The lora adapter '{name}' cannot be found.", 404)
        with self.engine.exclusive():
            remaining = [a for a in self.adapters if a != name]
            if remaining and name in self.peft.active_adapters:
                # Requests name their adapter, so which one is "active" does not matter here; but PEFT
                # warns when the active adapter is deleted: hand the role to the newest one first.
                self.peft.set_adapter(remaining[-1])
            self.peft.delete_adapter(name)
            del self.adapters[name]
            if not self.adapters:
                # PEFT keeps a stale active-adapter name once the last one is gone; its LoRA
                # layers pass inputs straight to the base layers, so serve the base model directly.
                self.engine.model, self.engine.use_adapters = self.base, False
        logger.info("unloaded LoRA adapter %s", name)
