"""Client settings (megacache_client/config.py): environment, overrides, units, and the errors that
name the variable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megacache_client.config import ClientConfig, ConfigError


def test_config_from_env_and_overrides(tmp_path: Path):
    env = {"MEGACACHE_URL": "http://127.0.0.1:1/", "MEGACACHE_MODE": "read-only",
           "MEGACACHE_READ_TIMEOUT_S": "2.5", "MEGACACHE_RETRIES": "0",
           "MEGACACHE_NODE_CACHE_DIR": str(tmp_path), "MEGACACHE_FALLBACK": "false"}
    cfg = ClientConfig.from_env(env)
    assert (cfg.url, cfg.mode, cfg.read_timeout_s, cfg.retries) == \
        ("http://127.0.0.1:1", "read-only", 2.5, 0)
    assert cfg.node_cache_dir == tmp_path and cfg.fallback is False
    assert cfg.enabled and not cfg.may_publish
    assert ClientConfig.from_env(env, mode="read-write").may_publish
    assert not ClientConfig.from_env({}).enabled  # no URL: off
    with pytest.raises(ConfigError, match="MEGACACHE_MODE"):
        ClientConfig.from_env({**env, "MEGACACHE_MODE": "sometimes"})
    with pytest.raises(ConfigError, match="READ_TIMEOUT_S"):
        ClientConfig.from_env({**env, "MEGACACHE_READ_TIMEOUT_S": "soon"})
    with pytest.raises(ConfigError, match="http"):
        ClientConfig.from_env({"MEGACACHE_URL": "ftp://x"})


@pytest.mark.parametrize("name, raw, message", [
    ("FALLBACK", "flase", "MEGACACHE_FALLBACK='flase' is not a boolean"),
    ("SHIP_KERNELS", "maybe", "MEGACACHE_SHIP_KERNELS='maybe' is not a boolean"),
    ("MAX_RAW_BYTES", "16 gigs", "MEGACACHE_MAX_RAW_BYTES='16 gigs' is not a size"),
    ("MAX_RAW_BYTES", "0", "MEGACACHE_MAX_RAW_BYTES must be positive"),
    ("RETRIES", "2.5", "MEGACACHE_RETRIES='2.5' is not a whole number"),
    ("RETRIES", "-1", "MEGACACHE_RETRIES must be 0 or more"),
    ("LOAD_DEADLINE_S", "soon", "MEGACACHE_LOAD_DEADLINE_S='soon' is not a number"),
    ("LOAD_DEADLINE_S", "0", "LOAD_DEADLINE_S must be positive"),
    ("TRUSTED_WRITERS", "ci main", "MEGACACHE_TRUSTED_WRITERS: 'ci main' is not a token name"),
    ("TRUSTED_WRITERS", "ci,../x", "MEGACACHE_TRUSTED_WRITERS: '../x' is not"),
    ("TRUSTED_WRITERS", "scope:adm*", "MEGACACHE_TRUSTED_WRITERS: 'scope:adm*' is not"),
    ("TRUSTED_WRITERS", "scope:", "MEGACACHE_TRUSTED_WRITERS: 'scope:' is not"),
])
def test_bad_settings_are_refused_with_the_variable_named(name: str, raw: str, message: str):
    with pytest.raises(ConfigError) as err:
        ClientConfig.from_env({"MEGACACHE_URL": "http://127.0.0.1:1", f"MEGACACHE_{name}": raw})
    assert message in str(err.value)


def test_settings_accept_units_and_boolean_words():
    env = {"MEGACACHE_MAX_RAW_BYTES": "16GiB", "MEGACACHE_FALLBACK": " No ",
           "MEGACACHE_SHIP_KERNELS": "ON", "MEGACACHE_LOAD_DEADLINE_S": "2.5"}
    cfg = ClientConfig.from_env(env)
    assert cfg.max_raw_bytes == 16 * 1024**3
    assert (cfg.fallback, cfg.ship_kernels, cfg.load_deadline_s) == (False, True, 2.5)
    assert ClientConfig.from_env({"MEGACACHE_MAX_RAW_BYTES": "512MB"}).max_raw_bytes == 512e6
    assert ClientConfig.from_env({"MEGACACHE_MAX_RAW_BYTES": "1000"}).max_raw_bytes == 1000
    assert ClientConfig.from_env({}, max_raw_bytes="1KiB").max_raw_bytes == 1024


def test_autoload_with_a_bad_setting_warns_and_the_process_runs(tmp_path: Path):
    """Zero-code mode cannot raise into the trainer: the error is one clear warning."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGACACHE_")}
    env.update({"MEGACACHE_URL": "http://127.0.0.1:1", "MEGACACHE_FALLBACK": "flase"})
    code = ("import logging, sys; logging.basicConfig(format='%(message)s'); "
            "import megacache_autoload; megacache_autoload._enable(); print('ran')")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ran"
    assert "MEGACACHE_FALLBACK='flase' is not a boolean" in out.stderr


def test_trusted_writers_read_names_prefixes_and_scopes():
    policy = ClientConfig.from_env({"MEGACACHE_TRUSTED_WRITERS": " ci-main, nightly-*,scope:admin"}
                                   ).writer_policy
    assert policy is not None
    assert policy.trusts("ci-main", ["read", "write"])
    assert policy.trusts("nightly-7", ["write"]) and policy.trusts("anyone", ["admin"])
    assert not policy.trusts("ci-main-2", ["write"]) and not policy.trusts("trainer", ["write"])
    assert "not a trusted writer" in policy.refusal(
        '{"writer":"trainer","writer_scopes":["read","write"]}')
    assert policy.refusal('{"writer":"ci-main","writer_scopes":["write"]}') == ""
    for unsaid in (None, "", "not json", '{"writer":1,"writer_scopes":[]}', "[]"):
        assert policy.refusal(unsaid) == "the server did not say who wrote it"
    assert ClientConfig.from_env({}).writer_policy is None
