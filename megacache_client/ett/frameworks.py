"""The checkpoints of the frameworks people train with, timed zero-code.

Most trainers do not call `torch.distributed.checkpoint` themselves: the Hugging Face
Trainer, Accelerate and Lightning save and restore through their own calls. Each is wrapped
when the trainer imports it (`imports.py`: never imported here), on rank 0 of a job with
telemetry on, and only within the versions below; outside them (or where a call is missing)
one warning and no hook. Nothing the framework does changes: the wrappers time the call and
return its result.

- transformers `Trainer`: saves `_save_checkpoint`; restores `_load_from_checkpoint`,
  `_load_optimizer_and_scheduler`, `_load_scaler` and `_load_rng_state`, summed into one;
- accelerate `Accelerator`: saves `save_state`; restores `load_state`;
- lightning and pytorch_lightning `Trainer`: saves `save_checkpoint` (with an
  `AsyncCheckpointIO`, in the background too, until its write is done); restores
  `_restore_modules_and_callbacks` and `restore_training_state`, one restore, sent at
  `resume_end`.

A restore made of several calls is summed (`Telemetry.restoring`) and sent once, at its
last call or the next optimizer step, with the step the trainer resumes from.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from megacache_client.ett import checkpoints
from megacache_client.torch import imports

log = logging.getLogger("megacache")


@dataclass(frozen=True)
class Framework:
    """One framework: its distribution, the versions whose calls are known, the module that
    defines them and how to wrap them."""

    package: str
    low: tuple[int, int]
    below: tuple[int, int]
    module: str
    patch: Callable[[ModuleType], None]

    @property
    def supported(self) -> str:
        return f">={_text(self.low)},<{_text(self.below)}"


def _text(v: tuple[int, int]) -> str:
    return ".".join(map(str, v))


def version_of(package: str) -> tuple[int, int] | None:
    """(major, minor) of an imported package, None when it cannot say."""
    found = re.match(r"(\d+)\.(\d+)", str(getattr(sys.modules.get(package), "__version__", "")))
    return (int(found.group(1)), int(found.group(2))) if found else None


# -- the wrappers ---------------------------------------------------------------------------
def _hf_step(args: tuple[Any, ...]) -> int | None:
    return int(args[0].state.global_step)


def _hf_given(args: tuple[Any, ...]) -> bool:
    """The Trainer's restore calls take the checkpoint's path first (None: none)."""
    return len(args) > 1 and args[1] is not None


def patch_hf_trainer(module: ModuleType) -> None:
    trainer = module.Trainer
    _require(trainer, "_save_checkpoint", "_load_from_checkpoint",
             "_load_optimizer_and_scheduler", "_load_rng_state")
    checkpoints.wrap(trainer, "_save_checkpoint", "save", _hf_step)
    for name in ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler"):
        checkpoints.wrap(trainer, name, "load_part", _hf_step, when=_hf_given)
    checkpoints.wrap(trainer, "_load_rng_state", "load_last", _hf_step, when=_hf_given)


def patch_accelerator(module: ModuleType) -> None:
    accelerator = module.Accelerator
    _require(accelerator, "save_state", "load_state")
    checkpoints.wrap(accelerator, "save_state", "save")
    checkpoints.wrap(accelerator, "load_state", "load")


def _pl_step(args: tuple[Any, ...]) -> int | None:
    return int(args[0].global_step)


def _pl_connector_step(args: tuple[Any, ...]) -> int | None:
    return int(args[0].trainer.global_step)


def _pl_loaded(args: tuple[Any, ...]) -> bool:
    """A checkpoint was read (the connector holds it until `resume_end`)."""
    return bool(getattr(args[0], "_loaded_checkpoint", None))


def _pl_async_write(package: str) -> Callable[[Any, tuple[Any, ...]], Any]:
    """For a trainer whose checkpoint IO is asynchronous: a future done when the write just
    submitted is (a no-op queued behind it on the IO's one worker thread)."""

    def background(_result: Any, args: tuple[Any, ...]) -> Any:
        io_module = sys.modules.get(f"{package}.plugins.io.async_plugin")
        io = getattr(getattr(args[0], "strategy", None), "checkpoint_io", None)
        executor = getattr(io, "_executor", None)
        if io_module is None or not isinstance(io, io_module.AsyncCheckpointIO) \
                or executor is None:
            return None
        return executor.submit(lambda: None)

    return background


def patch_lightning(package: str) -> Callable[[ModuleType], None]:
    def patch(module: ModuleType) -> None:
        trainer = module.Trainer
        connectors = sys.modules.get(f"{package}.trainer.connectors.checkpoint_connector")
        connector = getattr(connectors, "_CheckpointConnector", None)
        _require(trainer, "save_checkpoint")
        _require(connector, "_restore_modules_and_callbacks", "restore_training_state",
                 "resume_end")
        checkpoints.wrap(trainer, "save_checkpoint", "save", _pl_step,
                         background=_pl_async_write(package))
        for name in ("_restore_modules_and_callbacks", "restore_training_state"):
            checkpoints.wrap(connector, name, "load_part", _pl_connector_step, when=_pl_loaded)
        checkpoints.wrap(connector, "resume_end", "load_end", _pl_connector_step)

    return patch


def _require(owner: Any, *names: str) -> None:
    missing = [n for n in names if not callable(getattr(owner, n, None))]
    if owner is None or missing:
        raise AttributeError(f"{getattr(owner, '__name__', owner)} lacks "
                             f"{', '.join(missing) or 'the class'}")


FRAMEWORKS = (
    Framework("transformers", (4, 45), (6, 0), "transformers.trainer", patch_hf_trainer),
    Framework("accelerate", (0, 26), (2, 0), "accelerate.accelerator", patch_accelerator),
    Framework("lightning", (2, 0), (3, 0), "lightning.pytorch.trainer.trainer",
              patch_lightning("lightning.pytorch")),
    Framework("pytorch_lightning", (2, 0), (3, 0), "pytorch_lightning.trainer.trainer",
              patch_lightning("pytorch_lightning")),
)
"""The frameworks whose checkpoints are timed, and the versions tried (tests/test_frameworks.py
runs the installed ones)."""


def _patcher(fw: Framework) -> Callable[[ModuleType], None]:
    def patch(module: ModuleType) -> None:
        found = version_of(fw.package)
        why = ""
        if found is None or not fw.low <= found < fw.below:
            why = (f"{fw.package} {_text(found) if found else '(version unknown)'} is outside "
                   f"the versions megacache knows ({fw.supported})")
        else:
            try:
                fw.patch(module)
                return
            except Exception as exc:
                why = f"{fw.package} {_text(found)}: {exc}"
        log.warning("megacache: %s: its checkpoints are not timed for the job's ETT "
                    "(megacache_client.checkpoint() times them by hand)", why)

    return patch


def watch() -> None:
    """Wrap each framework's checkpoint calls when (if) the trainer imports it."""
    for fw in FRAMEWORKS:
        imports.when_imported(fw.module, _patcher(fw))
