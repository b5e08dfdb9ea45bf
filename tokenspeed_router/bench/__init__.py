"""``tokenspeed-router bench``: the index and routing benchmark that ships with the package.

Kept outside ``router/`` so the library's core holds no benchmark harness;
it drives the core only through public APIs (``KvIndex``, ``Router``). The
module is :mod:`tokenspeed_router.bench.cli_bench`.
"""
