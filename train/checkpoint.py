"""Training checkpoints with torch.distributed.checkpoint, and Hugging Face export of the policy.

Layout of ``<out>/checkpoints/step_<k>/`` (k = optimizer steps taken, i.e. the step to resume at)::

    .metadata, __*.distcp   model + optimizer state, sharded as trained (DCP); loads on any world size
    rng/rank<r>.pt          every RNG of rank r: torch CPU, CUDA, python, numpy
    trainer.json            {"step": k, ...} written last: a checkpoint without it is incomplete

``<out>/checkpoints/latest`` names the newest complete one. Rollout sources are pure functions of the
step, so model + optimizer + step + RNG is everything a resumed run needs to continue bit-identically.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "export_hf"]


class _TrainState(Stateful):
    """Model + optimizer in DCP's sharded form."""

    def __init__(self, model, optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def save_checkpoint(out_dir: str | Path, step: int, model, optimizer, extra: dict | None = None) -> Path:
    """Save at ``<out_dir>/checkpoints/step_<step>`` (a collective: every rank calls it)."""
    root = Path(out_dir) / "checkpoints"
    path = root / f"step_{step}"
    dcp.save({"train": _TrainState(model, optimizer)}, checkpoint_id=str(path))
    (path / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(), path / "rng" / f"rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        (path / "trainer.json").write_text(json.dumps({"step": step, **(extra or {})}, indent=1))
        (root / "latest").write_text(path.name + "\n")
    _barrier()
    return path


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``<out_dir>/checkpoints``, or None."""
    root = Path(out_dir) / "checkpoints"
    marker = root / "latest"
    if marker.is_file():
        path = root / marker.read_text().strip()
        if (path / "trainer.json").is_file():
            return path
    done = [p for p in root.glob("step_*") if (p / "trainer.json").is_file()]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def load_checkpoint(path: str | Path, model, optimizer) -> dict:
    """Restore model, optimizer and this rank's RNG from ``path``; returns the trainer record ({"step": k, ...})."""
    path = Path(path)
    meta = path / "trainer.json"
    if not meta.is_file():
        raise ValueError(f"resume: {path} is not a complete checkpoint (no trainer.json); expected a step_<k> "
                         "directory written by save_checkpoint")
    state = {"train": _TrainState(model, optimizer)}
    dcp.load(state, checkpoint_id=str(path))
    rng = path / "rng" / f"rank{_rank()}.pt"
    if not rng.is_file():
        raise ValueError(f"resume: {rng} is missing; expected the checkpoint to be resumed on the world size it "
                         "was saved with for a bit-identical continuation")
    _set_rng_state(torch.load(rng, weights_only=False))
    return json.loads(meta.read_text())


def export_hf(model, path: str | Path) -> Path | None:
    """Write the policy as a transformers checkpoint (config.json + safetensors) on rank 0; a collective."""
    from dualkv.models.model import CausalLM

    from .distributed import full_state_dict

    state = full_state_dict(model)
    if _rank() == 0:
        with torch.device("meta"):
            plain = CausalLM(model.config)
        plain = plain.to_empty(device="cpu")
        plain.load_state_dict(state)
        plain.tie_weights()
        plain.save_pretrained(path)
    _barrier()
    return Path(path) if _rank() == 0 else None
