"""``KernelOptions`` and the environment: the defaults, each switch read and bad values rejected naming
the variable, frozen options, a bad switch failing when a launcher is built, the pool's switches,
and ``kvpool/config.py`` the only module that reads the environment.
"""

from __future__ import annotations

import dataclasses
import io
import re
import tokenize
from pathlib import Path

import pytest
import torch

import kvpool
from kvassert import bits, needs_interpreter
from kvpool import MHATokenToKVPool
from kvpool.config import KernelOptions

CPU = "cpu"


# --- KernelOptions and the environment -----------------------------------------------------------

SWITCHES = {"KVPOOL_DIRECT_LAUNCH": "direct_launch", "KVPOOL_FAST_DIV": "fast_div", "KVPOOL_SOFT_CAST": "soft_cast"}


@pytest.fixture
def clean_env(monkeypatch):
    for name in (*SWITCHES, "KVPOOL_FUSED", "KVPOOL_VALIDATE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_kernel_options_defaults(clean_env):
    assert KernelOptions.from_env() == KernelOptions() == KernelOptions(direct_launch=True, fast_div=True, soft_cast=False)
    for name in SWITCHES:
        clean_env.setenv(name, "")  # empty means unset
    assert KernelOptions.from_env() == KernelOptions()


@pytest.mark.parametrize("value", ["0", "1"])
@pytest.mark.parametrize("name", list(SWITCHES))
def test_kernel_options_read_each_switch(clean_env, name, value):
    clean_env.setenv(name, value)
    options = KernelOptions.from_env()
    field = SWITCHES[name]
    assert getattr(options, field) is (value == "1")
    others = {f: getattr(KernelOptions(), f) for f in SWITCHES.values() if f != field}
    assert {f: getattr(options, f) for f in others} == others


@pytest.mark.parametrize("value", ["yes", "true", "2", " 1", "01", "on"])
@pytest.mark.parametrize("name", list(SWITCHES))
def test_kernel_options_reject_bad_values_naming_the_variable(clean_env, name, value):
    clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=rf"^{name} must be 0 or 1, got {re.escape(repr(value))}$"):
        KernelOptions.from_env()


def test_kernel_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        KernelOptions().fast_div = False  # type: ignore[misc]


@needs_interpreter
def test_a_bad_switch_fails_when_a_launcher_is_built(clean_env):
    """The switches are read when a pool's launcher is constructed, not on the hot path."""
    clean_env.setenv("KVPOOL_SOFT_CAST", "maybe")
    with pytest.raises(ValueError, match=r"KVPOOL_SOFT_CAST must be 0 or 1, got 'maybe'"):
        MHATokenToKVPool(8, 1, torch.float8_e4m3fn, 1, 8, 1, CPU, fused="always", warmup=False)
    clean_env.setenv("KVPOOL_SOFT_CAST", "1")
    pool = MHATokenToKVPool(8, 1, torch.float8_e4m3fn, 1, 8, 1, CPU, fused="always", warmup=False)
    assert pool._writer.soft_cast
    clean_env.setenv("KVPOOL_SOFT_CAST", "maybe")  # read once: later writes do not look again
    x = torch.ones(1, 1, 8)
    pool.set_kv_buffer(None, torch.tensor([1]), x, x, layer_id_override=0)
    assert (bits(pool.get_key_buffer(0)[1]) == 0x38).all()  # 1.0 in e4m3fn


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("KVPOOL_FUSED", "sometimes", r"KVPOOL_FUSED must be one of auto, always, never, got 'sometimes'"),
        ("KVPOOL_VALIDATE", "yes", r"KVPOOL_VALIDATE must be 0 or 1, got 'yes'"),
    ],
)
def test_pool_switches_reject_bad_values_naming_the_variable(clean_env, name, value, message):
    clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        MHATokenToKVPool(8, 1, torch.bfloat16, 1, 8, 1, CPU)


ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def test_only_config_reads_the_environment():
    """No module of kvpool but kvpool/config.py touches the process environment (code only:
    names in comments and strings do not count)."""
    package = Path(kvpool.__file__).parent
    files = sorted(package.rglob("*.py"))
    assert len(files) > 10
    readers = {}
    for path in files:
        source = path.read_text()
        names = {
            tok.string
            for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.NAME and tok.string in ENV_NAMES
        }
        if names:
            readers[str(path.relative_to(package))] = names
    assert readers == {"config.py": {"environ"}}
