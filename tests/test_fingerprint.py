"""Model identity and the fingerprint (megacache_client/steps/fingerprint.py), without
torch.compile."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import need


def test_identity_sees_through_bound_methods_partials_and_decorators():
    torch = need("torch")
    from megacache_client.steps.fingerprint import identity

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.fc(x)

    class Decoder(torch.nn.Module):
        def forward(self, x):
            return x * 2

    class Trainer:
        def step(self, x):
            return x + 1

    def loss(a, b):
        return (a - b).abs().mean()

    @functools.wraps(loss)
    def logged(*args):
        return loss(*args)

    enc, dec = Encoder(), Decoder()
    assert identity(enc._call_impl) == identity(enc)  # what nn.Module.compile() passes
    assert identity(enc._call_impl).name == "Encoder"
    assert identity(dec._call_impl).name == "Decoder"
    assert identity(enc).code != identity(dec).code
    assert identity(enc.forward).name == "Encoder.forward"
    assert identity(enc.forward).code == identity(enc).code
    assert identity(torch.compile(enc)) == identity(enc)
    assert identity(torch.nn.DataParallel(enc)).name == "Encoder"  # a torch wrapper
    assert identity(torch.nn.DataParallel(enc)._call_impl).name == "Encoder"
    assert identity(Trainer().step).name == "Trainer.step"
    assert identity(loss).name.endswith("loss")
    assert identity(functools.partial(loss, b=1)) == identity(loss)
    assert identity(logged) == identity(loss)
    assert identity(loss).code != identity(Trainer().step).code


def test_fingerprint_config_takes_compile_options_and_ignores_defaults():
    need("torch")
    from megacache_client.steps.fingerprint import compute, describe, differing

    plain = compute(model="m", code="c")
    spelled_out = compute(model="m", code="c", options={"fullgraph": False, "dynamic": None,
                                                        "mode": None, "disable": False})
    assert plain.key() == spelled_out.key()
    full = compute(model="m", code="c", options={"fullgraph": True})
    tuned = compute(model="m", code="c", options={"options": {"max_autotune": True}})
    assert len({plain.key(), full.key(), tuned.key()}) == 3
    assert differing(plain, full) == ["config"]
    assert "fullgraph: False vs True" in describe(plain, full)


ENABLE_FACTS = r"""
import json, os, sys
import torch
from megacache_client.torch import relocate
from megacache_client.torch import env as torch_env
cheap = {"hw": torch_env.hw_component(), "cache": str(torch_env.inductor_cache_dir()),
         "headers": str(torch_env.header_dir()), "facts": relocate.build_facts()}
loaded = sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)
from torch._inductor import codecache
from torch._inductor.cpp_builder import get_cpp_compiler
from torch._inductor.runtime.cache_dir_utils import cache_dir
print(json.dumps({"loaded": loaded, "cheap": cheap, "compiler": torch_env.cpp_compiler(),
                  "torch_compiler": get_cpp_compiler(), "torch_cache": cache_dir(),
                  "torch_headers": codecache._HEADER_DIR,
                  "hw": torch_env.hw_component(), "facts": relocate.build_facts()}))
"""


def test_the_facts_enable_needs_come_without_importing_dynamo_and_match_inductors(
        tmp_path: Path):
    """The hw component, the cache and header dirs and the build facts are what enable
    computes before the trainer's own code runs; importing Inductor for them would cost
    every start ~2 s. Found without it, they must still be exactly what Inductor uses."""
    need("torch")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MEGACACHE_", "TORCHINDUCTOR_"))}
    env["TMPDIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", ENABLE_FACTS], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["loaded"] == [], "enable's facts imported torch's compiler"
    assert seen["compiler"] == seen["torch_compiler"]
    assert seen["cheap"]["cache"] == seen["torch_cache"]
    assert seen["cheap"]["headers"] == seen["torch_headers"]
    assert seen["cheap"]["headers"].startswith(str(tmp_path))
    assert seen["cheap"]["hw"] == seen["hw"] and seen["cheap"]["facts"] == seen["facts"]
    assert seen["hw"]["cxx"]
