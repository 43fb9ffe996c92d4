"""Model identity and the fingerprint (megacache_client/fingerprint.py), without torch.compile."""

from __future__ import annotations

import functools

from conftest import need


def test_identity_sees_through_bound_methods_partials_and_decorators():
    torch = need("torch")
    from megacache_client.fingerprint import identity

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
    from megacache_client.fingerprint import compute, describe, differing

    plain = compute(model="m", code="c")
    spelled_out = compute(model="m", code="c", options={"fullgraph": False, "dynamic": None,
                                                        "mode": None, "disable": False})
    assert plain.key() == spelled_out.key()
    full = compute(model="m", code="c", options={"fullgraph": True})
    tuned = compute(model="m", code="c", options={"options": {"max_autotune": True}})
    assert len({plain.key(), full.key(), tuned.key()}) == 3
    assert differing(plain, full) == ["config"]
    assert "fullgraph: False vs True" in describe(plain, full)
