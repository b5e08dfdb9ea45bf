"""The compiled core must be built wherever the suite runs from the Makefile.

A few tests skip themselves when the extension is missing (a machine without a
C compiler still installs and runs the reference core). That must never hide a
broken build in development or CI: this test fails unless the core is built,
except where ``TOKENSPEED_ROUTER_ALLOW_NO_NATIVE=1`` says the reference core is
wanted on purpose.
"""

from __future__ import annotations

import os

from tokenspeed_router.router.index import NATIVE_AVAILABLE, KvIndex


def test_native_core_is_built_and_used_by_default() -> None:
    if os.environ.get("TOKENSPEED_ROUTER_ALLOW_NO_NATIVE") == "1":
        return
    assert NATIVE_AVAILABLE, (
        "the compiled index core did not build (setup.py, csrc/): "
        "reinstall with `make clean install` and read the compiler output"
    )
    if os.environ.get("TOKENSPEED_ROUTER_INDEX", "") != "reference":
        assert KvIndex().statistics()["core"] == "native"
