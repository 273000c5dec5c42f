"""Weight changes of the embedded server: full weights from disk in place, LoRA adapters via PEFT.

Both run between decode steps (``Engine.exclusive``). Full-weight updates read a
checkpoint-format folder (``*.safetensors`` as written by ``save_pretrained``, one file or
shards) and copy each tensor into the live parameter of the same name, so running
sequences continue on the new weights, as on vLLM. Names may carry PEFT's ``.base_layer``
segment or ``base_model.model.`` prefix (vLLM with ``--enable-lora`` needs the same mapping),
or be the checkpoint's names where transformers renamed weights on load (Qwen3.5's
``model.language_model.…``); they are mapped back to the base model's names. Tensors of parts the
server never loaded (a VLM's vision tower) are skipped.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from grpo_core.errors import ServingError
from grpo_core.serving.embedded.engine import Engine

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


#: Name prefix of the temporary folders holding adapters fetched from a URL (deleted when unloaded).
FETCHED_PREFIX = "grpo-adapter-"


def fetch_adapter(path: str) -> str:
    """A local folder holding the adapter at ``path``: ``path`` itself, or for an fsspec URL (``s3://…``,
    ``file://…``; ``train.adapter_store``) a copy of its files in a fresh temporary folder.

    Raises:
        AdapterError: the URL lists no ``adapter_config.json`` (404; the store may not show it yet: retried by
            the trainer's fan-out).
    """
    if "://" not in path:
        return path
    import fsspec

    fs, root = fsspec.core.url_to_fs(path)
    try:
        files = [e for e in fs.ls(root, detail=True) if e.get("type") == "file"]
    except FileNotFoundError:
        files = []
    if not any(Path(e["name"]).name == "adapter_config.json" for e in files):
        raise AdapterError(f"No adapter found for {path}: adapter_config.json is missing.", 404)
    local = Path(tempfile.mkdtemp(prefix=FETCHED_PREFIX))
    for entry in files:
        fs.get_file(entry["name"], str(local / Path(entry["name"]).name))
    return str(local)


class WeightManager:
    """Owns the base model's parameters and the PEFT wrapper of the embedded server.

    Args:
        engine: the decode engine whose model is updated.
        max_lora_rank: largest adapter rank accepted (as vLLM's ``--max-lora-rank``).
    """

    def __init__(self, engine: Engine, max_lora_rank: int = 512, model_path: str | Path | None = None) -> None:
        self.engine = engine
        self.base = engine.model
        self.max_lora_rank = max_lora_rank
        self.params: dict[str, torch.Tensor] = dict(self.base.state_dict(keep_vars=True))
        self.aliases: dict[str, str] = {}
        self.not_loaded: set[str] = set()
        if model_path is not None:  # the checkpoint's names (e.g. Qwen3.5's model.language_model.…) → the model's
            from grpo_core.models.text_model import checkpoint_keys, checkpoint_name_map

            names = checkpoint_name_map(self.base, model_path)
            self.aliases = {ckpt: own for own, ckpt in names.items() if ckpt != own}
            # parts of the checkpoint this server never loaded (a VLM's vision tower): kept as they are
            self.not_loaded = checkpoint_keys(model_path) - set(names.values())
        self.adapters: dict[str, str] = {}
        """Adapters served to new requests: name -> folder."""
        self.retiring: dict[str, str] = {}  # unloaded adapters still used by in-flight sequences -> their path
        """Unloaded adapters that queued or running sequences still sample from; deleted once none does."""
        self.peft: Any = None
        self._names = threading.Lock()  # serving checks and submits vs. unloads (see :meth:`submit`)

    def submit(self, adapter: str | None, seqs: list[Any]) -> bool:
        """Queue ``seqs`` on the engine if ``adapter`` (None = the base model) is still served; returns whether
        it was (an unload between a request's check and its submit would otherwise delete an adapter in use)."""
        with self._names:
            if adapter is not None and adapter not in self.adapters:
                return False
            self.engine.submit(seqs)
            return True

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
                    name = canonical_name(key)
                    if name not in self.not_loaded:
                        incoming[self.aliases.get(name, name)] = f.get_tensor(key)
        unknown = sorted(set(incoming) - set(self.params))
        if unknown:
            raise ServingError(f"{len(unknown)} tensors in {path} match no model parameter, e.g. {unknown[:3]}")
        bad = [n for n, t in incoming.items() if t.shape != self.params[n].shape]
        if bad:
            raise ServingError(
                f"shape mismatch for {bad[:3]}: e.g. {tuple(incoming[bad[0]].shape)} vs "
                f"{tuple(self.params[bad[0]].shape)}"
            )
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
        path = fetch_adapter(path)
        if not (Path(path) / "adapter_config.json").is_file():
            raise AdapterError(f"No adapter found for {path}: adapter_config.json is missing.", 404)
        rank = LoraConfig.from_pretrained(path).r
        if rank > self.max_lora_rank:
            raise AdapterError(f"LoRA rank {rank} is greater than max_lora_rank {self.max_lora_rank}.", 400)
        with self.engine.exclusive(), self._in_model_names(path) as folder:
            self._delete_retired(also=name)  # a reload of a retiring name replaces it in place, under the step lock
            if self.peft is None:
                self.peft = PeftModel.from_pretrained(self.base, folder, adapter_name=name, is_trainable=False)
                self.peft.eval()
                self.engine.model = self.peft
                self.engine.use_adapters = True
            else:
                self.peft.load_adapter(folder, adapter_name=name, is_trainable=False)
                if not self.adapters:  # the wrapper was bypassed after its last adapter left
                    self.peft.set_adapter(name)
                    self.engine.model, self.engine.use_adapters = self.peft, True
            self.adapters[name] = path
        logger.info("loaded LoRA adapter %s (r=%d) from %s", name, rank, path)

    @contextlib.contextmanager
    def _in_model_names(self, path: str) -> Iterator[str]:
        """``path``, or a temporary copy of the adapter whose tensor names are this model's where the
        adapter uses the checkpoint's (Qwen3.5's ``model.language_model.…``, as vLLM needs them): PEFT's
        own mapping back misses names whose renamed form is a suffix of the original."""
        from safetensors.torch import load_file, save_file

        from grpo_core.models.text_model import rename_module_key

        file = Path(path) / "adapter_model.safetensors"
        prefix = "base_model.model."
        tensors = load_file(str(file)) if self.aliases and file.is_file() else {}
        renamed = {prefix + rename_module_key(k.removeprefix(prefix), self.aliases): v for k, v in tensors.items()}
        if renamed.keys() == tensors.keys():
            yield path
            return
        with tempfile.TemporaryDirectory(prefix="adapter-") as tmp:
            shutil.copy2(Path(path) / "adapter_config.json", tmp)
            save_file(renamed, str(Path(tmp) / "adapter_model.safetensors"), metadata={"format": "pt"})
            yield tmp

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``: new requests naming it get 404 from now on; sequences already
        queued or running with it finish on it (an unload never fails them), and its weights are deleted at
        the first adapter change after the last of them finished.

        Raises:
            AdapterError: the adapter is not loaded (404).
        """
        with self._names:
            if name not in self.adapters:
                raise AdapterError(f"The lora adapter '{name}' cannot be found.", 404)
            self.retiring[name] = self.adapters.pop(name)
        with self.engine.exclusive():
            self._delete_retired()
        if name in self.retiring:
            logger.info("unloaded LoRA adapter %s; in-flight sequences finish on it before it is deleted", name)
        else:
            logger.info("unloaded LoRA adapter %s", name)

    def _delete_retired(self, also: str | None = None) -> None:
        """Delete the retiring adapters no sequence uses (and ``also``, if retiring); caller holds the step lock."""
        in_use = self.engine.adapters_in_use()
        for name in sorted(self.retiring):
            if name in in_use and name != also:
                continue
            path = self.retiring.pop(name)
            remaining = [a for a in [*self.adapters, *self.retiring] if a != name]
            if remaining and name in self.peft.active_adapters:
                # Requests name their adapter, so which one is "active" does not matter here; but PEFT
                # warns when the active adapter is deleted: hand the role to the newest one first.
                self.peft.set_adapter(remaining[-1])
            self.peft.delete_adapter(name)
            if Path(path).name.startswith(FETCHED_PREFIX) and Path(path).parent == Path(tempfile.gettempdir()):
                shutil.rmtree(path, ignore_errors=True)  # our copy of an adapter fetched from a URL
        if not self.adapters and not self.retiring and self.peft is not None:
            # PEFT keeps a stale active-adapter name once the last one is gone; its LoRA
            # layers pass inputs straight to the base layers, so serve the base model directly.
            self.engine.model, self.engine.use_adapters = self.base, False
