"""The adapter: a re-export of the contract (``conformance.contract``), kept because third-party
adapters import it by this name. New code imports ``conformance.contract``."""

from conformance.contract import *  # noqa: F403
from conformance.contract import __all__  # noqa: F401
