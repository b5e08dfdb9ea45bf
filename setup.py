"""Build of the compiled core (tokenspeed_router._native); everything else is in pyproject.toml.

Plain C against the CPython API with xxHash vendored as one header
(csrc/xxhash, BSD-2-Clause): the machine's C compiler and Python's headers
are all it needs, nothing is downloaded at build time. ``optional=True``: a
machine without a compiler still installs the package, and ``KvIndex`` then
runs its pure-Python reference core (slower, same answers).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tokenspeed_router._native",
            sources=["csrc/native.c"],  # includes csrc/ingest_decode.c
            depends=["csrc/ingest_decode.c"],
            include_dirs=["csrc/xxhash"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wno-missing-braces"],
            optional=True,
        )
    ]
)
