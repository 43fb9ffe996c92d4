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


def test_class_source_is_what_inspect_gives_with_each_file_parsed_once(tmp_path: Path):
    """The fingerprint's fast class source (`steps/sources.py`) gives exactly
    `inspect.getsource` for every class of the modules a model's fingerprint reads, and for
    the shapes that make a class hard to find: decorated, nested, defined in a function, in
    an `if`/`try`/`with`/`match` block, redefined later in its file (inspect takes the first
    definition), with comments trailing its body; a class it cannot find is left to inspect
    (None), never guessed."""
    import importlib
    import inspect

    from megacache_client.steps import sources

    sample = tmp_path / "shapes.py"
    sample.write_text(
        "import functools\n"
        "def deco(c):\n    return c\n"
        "@deco\n@functools.total_ordering\nclass Decorated:\n"
        "    def __lt__(self, o):\n        return False\n"
        "    # a trailing comment of the body\n\n"
        "class Outer:\n    class Inner:\n        x = 1\n\n"
        "def factory():\n    class Local:\n        y = 2\n    return Local\n"
        "if True:\n    class InIf:\n        pass\n"
        "try:\n    class InTry:\n        pass\nexcept Exception:\n    class InExcept:\n"
        "        pass\n"
        "match 1:\n    case 1:\n        class InMatch:\n            pass\n"
        "class Twice:\n    first = True\n"
        "class Twice:  # noqa\n    first = False\n"
        "Made = type('Made', (), {})\n")
    sys.path.insert(0, str(tmp_path))
    try:
        shapes = importlib.import_module("shapes")
    finally:
        sys.path.remove(str(tmp_path))
    classes = [shapes.Decorated, shapes.Outer, shapes.Outer.Inner, shapes.factory(),
               shapes.InIf, shapes.InTry, shapes.InMatch, shapes.Twice]
    names = ["torch.nn.modules.conv", "torch.nn.modules.transformer"]
    if importlib.util.find_spec("transformers") is not None:
        names += ["transformers.models.gpt2.modeling_gpt2", "transformers.models.t5.modeling_t5"]
        from transformers.generation.utils import GenerationMixin
        from transformers.modeling_utils import ModuleUtilsMixin, PreTrainedModel

        classes += [GenerationMixin, ModuleUtilsMixin, PreTrainedModel]  # ~4,000 lines each
    for name in names:
        module = importlib.import_module(name)
        classes += [c for c in vars(module).values()
                    if inspect.isclass(c) and c.__module__ == name]
    assert len(classes) > 30
    for cls in classes:
        assert sources.class_source(cls) == inspect.getsource(cls), cls.__qualname__
    assert sources.class_source(shapes.Made) is None  # no class statement: inspect's call
    assert sources.class_source(int) is None  # no source file
