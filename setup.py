"""Build hook for asyncrl's one optional C extension; the metadata lives in pyproject.toml.

``asyncrl.queue._fastgroups`` speeds up the sample stream's group codec. It is optional:
where it cannot be compiled (no C compiler), the install goes on and the codec runs its
pure-Python path, which gives the same results.
"""

import numpy
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "asyncrl.queue._fastgroups",
            ["asyncrl/queue/_fastgroups.c"],
            include_dirs=[numpy.get_include()],
            optional=True,
        )
    ]
)
