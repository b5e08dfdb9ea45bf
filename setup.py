"""Build of the compiled core (tokenspeed_router._native); everything else is in pyproject.toml.

Plain C against the CPython API with xxHash vendored as one header
(csrc/xxhash, BSD-2-Clause): the machine's C compiler and Python's headers
are all it needs, nothing is downloaded at build time. One extension module
compiled from every ``csrc/*.c`` (csrc/native.c lists what each file holds;
``depends`` names the headers so that editing one rebuilds). ``optional=True``: a
machine without a compiler still installs the package, and ``KvIndex`` then
runs its pure-Python reference core (slower, same answers).
"""

from glob import glob

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tokenspeed_router._native",
            sources=sorted(glob("csrc/*.c")),
            depends=sorted(glob("csrc/*.h")),
            include_dirs=["csrc/xxhash"],
            # hidden: only PyInit__native is exported, the files share their symbols privately
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wno-missing-braces", "-fvisibility=hidden"],
            optional=True,
        )
    ]
)
