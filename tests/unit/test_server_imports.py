"""The router process deploys without torch (DESIGN §2): nothing under server/ or tools/ imports it."""

import subprocess
import sys


def test_server_side_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import tokenspeed_router.server\n"
        "from tokenspeed_router.server import cli_serve, http, zmq_api\n"
        "from tokenspeed_router.tools import cli_record, cli_replay, cli_inspect, decision_replay\n"
        "assert 'torch' not in sys.modules, 'torch imported by the server'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
