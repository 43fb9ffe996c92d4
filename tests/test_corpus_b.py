"""The second half of the corpus (tests/test_corpus.py says what is proved and why).

A file of its own so that `--dist loadfile` runs the two halves on two workers.
"""

from __future__ import annotations

import pytest
from test_corpus import GROUP_B, cache, check_new_machines, gxx  # noqa: F401

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("torch_s_own_compile_threads")]


@pytest.mark.parametrize("name", GROUP_B)
def test_new_machines_match_the_cold_run_b(cache, gxx, tmp_path, name, toolchain):  # noqa: F811
    check_new_machines(cache, gxx, tmp_path, name, toolchain)
