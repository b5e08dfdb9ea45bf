"""The router side must import and run without torch (DESIGN §2)."""

import subprocess
import sys


def test_router_side_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import tokenspeed_router, tokenspeed_router.events, tokenspeed_router.hashing\n"
        "import tokenspeed_router.router, tokenspeed_router.cli\n"
        "import tokenspeed_router.relay, tokenspeed_router.relay.cli_relay, tokenspeed_router.relay.metrics\n"
        "assert 'torch' not in sys.modules, 'torch imported by the router side'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
