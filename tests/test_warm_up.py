"""`megacache_client.warm_up`: the compile happens on a fast batch in the background, the
first real step compiles nothing, and the model, its optimizer and torch's generators are
exactly as if there had been no warm-up (real torch.compile on a tiny CPU model)."""

from __future__ import annotations

import copy
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import need  # noqa: E402

torch = need("torch", "warm_up compiles a real model")
from ddp_warm_up_job import compiles  # noqa: E402  (tests/ddp_warm_up_job.py)
from ddp_warm_up_job import model as tiny_model  # noqa: E402
from torch import nn  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import megacache_client  # noqa: E402
from megacache_client.torch import start_clock  # noqa: E402

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def fresh_dynamo(tmp_path_factory: pytest.TempPathFactory,
                 monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test compiles from an empty Dynamo; Inductor's cache is the module's (later
    tests reuse kernels: faster, and still a compile by Dynamo's and Inductor's counters)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(_cache_dir(tmp_path_factory)))
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


_CACHE: list[Path] = []


def _cache_dir(factory: pytest.TempPathFactory) -> Path:
    if not _CACHE:
        _CACHE.append(factory.mktemp("inductor"))
    return _CACHE[0]


def _step(compiled: nn.Module, model: nn.Module, opt: torch.optim.Optimizer,
          x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(1)
    loss = nn.functional.cross_entropy(compiled(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    opt_state = [v for s in opt.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)]
    return [*model.state_dict().values(), *grads, *opt_state, torch.get_rng_state()]


def test_after_warm_up_the_first_step_compiles_nothing_and_matches_no_warm_up() -> None:
    warm, plain = tiny_model(), tiny_model()
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 0, 1])
    warm_opt = torch.optim.SGD(warm.parameters(), lr=0.1, momentum=0.9)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    compiled = torch.compile(warm)
    fast_batch = torch.randn(4, 8)
    torch.manual_seed(7)
    before = [t.clone() for t in _state(warm, warm_opt)]
    handle = megacache_client.warm_up(compiled, fast_batch)
    seconds = handle.wait(600)
    assert seconds is not None and seconds > 0 and handle.error is None
    assert counters["inductor"]["fxgraph_cache_miss"] + \
        counters["inductor"]["fxgraph_cache_hit"] == 2, "forward and backward compiled"
    # no trace: no .grad, the same buffers, optimizer state and generator
    assert all(p.grad is None for p in warm.parameters())
    after = _state(warm, warm_opt)
    assert len(after) == len(before) and all(
        torch.equal(a, b) for a, b in zip(after, before, strict=True))

    compiled_before = compiles()
    warm_loss = _step(compiled, warm, warm_opt, x, y)
    assert compiles() == compiled_before, "the first real step compiled again"

    torch.manual_seed(7)  # the control: the same trainer, no warm-up
    plain_loss = _step(torch.compile(plain), plain, plain_opt, x, y)
    assert torch.equal(warm_loss, plain_loss)
    for a, b in zip(_state(warm, warm_opt), _state(plain, plain_opt), strict=True):
        assert torch.equal(a, b)


def test_the_first_call_waits_for_the_warm_up_instead_of_compiling_twice() -> None:
    model = tiny_model()
    compiled = torch.compile(model)
    handle = megacache_client.warm_up(compiled, torch.randn(4, 8))
    compiled(torch.randn(4, 8)).sum().backward()  # at once: the pre-hook waits
    assert handle.done and handle.error is None
    assert counters["frames"]["total"] == 1, "the frame was compiled twice"
    assert counters["stats"]["unique_graphs"] == 1


def test_a_failed_warm_up_warns_once_and_training_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_model()
    compiled = torch.compile(model)
    buffers = copy.deepcopy(list(model.buffers()))
    caplog.set_level(logging.WARNING, logger="megacache")
    handle = megacache_client.warm_up(compiled, torch.randn(4, 5))  # wrong width
    assert handle.wait(600) is None and handle.error
    warnings = [r for r in caplog.records if "warm-up failed" in r.getMessage()]
    assert len(warnings) == 1
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), buffers, strict=True))
    assert all(p.grad is None for p in model.parameters())
    compiled(torch.randn(4, 8)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_compiled_call_in_a_warm_up_is_not_the_first_step() -> None:
    """The start clock times the loop's first step, not the background one (no compile
    needed: a plain module stands for the compiled one)."""
    clock = start_clock.TimeToStart()
    module = start_clock.watch(nn.Linear(2, 2), clock)
    with start_clock.not_a_step():
        module(torch.randn(1, 2)).sum().backward()
    assert clock.forward_end is None and clock.first_step_end is None
    module(torch.randn(1, 2)).sum().backward()
    assert clock.forward_end is not None and clock.first_step_end is not None


def test_a_ddp_model_warms_up_without_collectives_or_the_reducer(tmp_path: Path) -> None:
    """DDP(torch.compile(model)): the inner module runs in DDP's forward context (no
    collective, no reducer), so the first DDP step compiles nothing and its backward (the
    reducer's first) goes through. In a child process (tests/ddp_warm_up_job.py): a Reducer
    freed in the test worker can deadlock it beyond any timeout."""
    need("torch.distributed", "the DDP warm-up runs a real process group")
    run = subprocess.run([sys.executable, str(Path(__file__).parent / "ddp_warm_up_job.py"),
                          str(tmp_path / "store")], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    facts = json.loads(run.stdout.strip().splitlines()[-1])
    assert facts["warmed"], facts["error"]
    assert facts["compiles_after_warm_up"] > 0  # the warm-up compiled
    assert facts["grads_after_warm_up"] == 0  # and left no trace
    assert facts["compiles_after_steps"] == facts["compiles_after_warm_up"]
    assert facts["grads_after_steps"] == facts["params"]
