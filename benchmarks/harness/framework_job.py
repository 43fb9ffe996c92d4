"""A trainer on a framework (FRAMEWORK: hf, accelerate, lightning or pytorch_lightning),
zero-code, for the framework ETT test and benchmark (tests/test_frameworks.py,
benchmarks/frameworks_ett.py): killed after a checkpoint and resumed.

MEGACACHE_URL, MEGACACHE_JOB_ID and MEGACACHE_ATTEMPT come from the environment; nothing
here calls megacache. A tiny linear model trains STEPS optimizer steps on batches whose
loading sleeps DATA_S each (the data loader is slow), saving a checkpoint every EVERY steps
the framework's own way: the Hugging Face Trainer's `save_steps`, Accelerate's `save_state`,
Lightning's `Trainer.save_checkpoint`. In attempt 0 it SIGKILLs itself KILL_AFTER steps
after step KILL_AT's checkpoint; attempt 1 resumes from the last checkpoint. Its own clock
goes to $TRUTH (a line a fact, flushed): started, first_step, each save (began, blocking
seconds), kill, end, and the seconds its data loading slept after its first step.
"""

from __future__ import annotations

import time

STARTED = time.time()

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402  (the client enables itself right after this import)
from torch import nn  # noqa: E402

FRAMEWORK = os.environ["FRAMEWORK"]
ATTEMPT = int(os.environ["MEGACACHE_ATTEMPT"])
STEPS, EVERY = int(os.environ["STEPS"]), int(os.environ["EVERY"])
KILL_AT, KILL_AFTER = int(os.environ["KILL_AT"]), int(os.environ["KILL_AFTER"])
DATA_S = float(os.environ["DATA_S"])
OUT = Path(os.environ["OUT"])
SLEPT = [0.0]
"""Seconds the data loading really slept (a loaded machine oversleeps: 10 ms is often 13)."""


def fact(name: str, **fields: Any) -> None:
    with open(os.environ["TRUTH"], "a") as f:
        f.write(json.dumps({"fact": name, "attempt": ATTEMPT, "at": time.time(), **fields})
                + "\n")
        f.flush()
        os.fsync(f.fileno())


class Slow(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A batch takes DATA_S to load (counted once the loop has started)."""

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        began = time.perf_counter()
        time.sleep(DATA_S)
        SLEPT[0] += time.perf_counter() - began
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(8, generator=g), "labels": torch.randn(1, generator=g)}


BALLAST = 4_000_000
"""Floats of a buffer every checkpoint carries (16 MB): a save of the bare linear model took
~5 ms, so one preemption of a loaded machine between the job's clock and the client's doubled
one side of the comparison (a save of tens of ms is what the figures can check)."""


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)
        self.register_buffer("ballast", torch.zeros(BALLAST))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        out = self.fc(x)
        return {"loss": (out - labels).pow(2).mean()} if labels is not None else out


class Clock:
    """The job's own clock around its steps: first step, kill."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.slept_at_first = 0.0
        self.kill_when: int | None = None

    def step_done(self, step: int) -> None:
        if self.first is None:
            self.first = time.time()
            self.slept_at_first = SLEPT[0]
            fact("first_step", step=step)
        if ATTEMPT == 0 and step == KILL_AT:
            self.kill_when = step + KILL_AFTER
        if self.kill_when is not None and step >= self.kill_when:
            time.sleep(float(os.environ.get("KILL_DELAY_S", "0")))  # training, unsaved
            fact("kill", step=step, slept=SLEPT[0] - self.slept_at_first)
            os.kill(os.getpid(), signal.SIGKILL)

    def end(self) -> None:
        fact("end", slept=SLEPT[0] - self.slept_at_first)


def saved(at: float, step: int) -> None:
    fact("save", began=at, blocking_s=time.time() - at, step=step)


def run_hf(clock: Clock) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Timing(TrainerCallback):
        began = 0.0

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.began = time.time()  # the save, if any, comes right after this
            clock.step_done(state.global_step)

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            saved(self.began, state.global_step)

    args = TrainingArguments(output_dir=str(OUT), max_steps=STEPS, save_steps=EVERY,
                             save_strategy="steps", per_device_train_batch_size=4,
                             logging_steps=10_000, report_to=[], use_cpu=True,
                             dataloader_num_workers=0, dataloader_pin_memory=False,
                             disable_tqdm=True, save_total_limit=2)
    trainer = Trainer(model=Net(), args=args, train_dataset=Slow(), callbacks=[Timing()])
    trainer.train(resume_from_checkpoint=ATTEMPT > 0 or None)


def run_accelerate(clock: Clock) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(Slow(), batch_size=4, shuffle=False)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    start = 0
    latest = OUT / "latest"
    if ATTEMPT > 0 and latest.exists():
        start = int(latest.read_text())
        accelerator.load_state(str(OUT / f"step-{start}"))
    for step, batch in enumerate(loader, start=start + 1):
        accelerator.backward(model(**batch)["loss"])
        opt.step()
        opt.zero_grad()
        clock.step_done(step)
        if step % EVERY == 0:
            at = time.time()
            accelerator.save_state(str(OUT / f"step-{step}"))
            saved(at, step)
            latest.write_text(str(step))
        if step >= STEPS:
            break


def run_lightning(clock: Clock) -> None:
    if FRAMEWORK == "pytorch_lightning":
        import pytorch_lightning as L
    else:
        import lightning as L  # type: ignore[no-redef]

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            return self.net(**batch)["loss"]

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Saving(L.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            step = trainer.global_step
            if step % EVERY == 0:
                at = time.time()
                trainer.save_checkpoint(str(OUT / f"step-{step}.ckpt"))
                saved(at, step)
                (OUT / "latest").write_text(str(step))
            clock.step_done(step)

    loader = torch.utils.data.DataLoader(Slow(), batch_size=4, shuffle=False)
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Saving()])
    latest = OUT / "latest"
    ckpt = str(OUT / f"step-{latest.read_text()}.ckpt") if ATTEMPT > 0 else None
    trainer.fit(Module(), loader, ckpt_path=ckpt)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    fact("started", at0=STARTED)
    clock = Clock()
    {"hf": run_hf, "accelerate": run_accelerate, "lightning": run_lightning,
     "pytorch_lightning": run_lightning}[FRAMEWORK](clock)
    clock.end()
    print(json.dumps({"framework": FRAMEWORK, "attempt": ATTEMPT}))  # run_job's last line


if __name__ == "__main__":
    main()
