"""Which packages the wheel holds. Code packages are discovered (a hand-kept list once dropped
two subpackages from the wheel without any error); the bundled fixtures and golden traces ship
as data packages under ``refengine/`` (see ``refengine/data.py``). Everything else lives in
pyproject.toml."""

from setuptools import find_packages, setup

DATA_PACKAGES = {"refengine._fixtures": "fixtures", "refengine._golden": "golden"}

setup(
    packages=[*find_packages(include=["refengine", "refengine.*", "conformance",
                                      "conformance.*", "specwire"]), *DATA_PACKAGES],
    package_dir=DATA_PACKAGES,
)
