"""``specgate repro --emit-pytest``: a scenario as a standalone pytest module.

The module is the regression repro script a backend's own test suite commits: it holds the
scenario's JSON and one test that replays it on the backend the specgate pytest plugin loads
(``--specgate-backend``, fixture ``specgate_backend``), failing with the same divergence block
``specgate repro`` prints. It needs specgate installed (its plugin and its replay), nothing
from the checkout it was made in.
"""

from __future__ import annotations

import re

from conformance.repro.scenario import Scenario, to_json

# what pytest collects, and safe inside the docstring
MODULE_NAME = re.compile(r"test_[A-Za-z0-9_]+\.py")

TEMPLATE = '''"""Regression repro emitted by `specgate repro --emit-pytest`.

Run it with: pytest {module} --specgate-backend <backend> (without a backend named it fails:
a repro that ran on the reference engine by accident would pass while the bug is present).
It replays SCENARIO through specgate's adapter: {actions} actions over {runs} engine
instance(s), each then run to completion, checking the invariants after every step, greedy
outputs against the reference, finish reasons, and that each run ends idle. CHECK names the
check it was recorded from, RECORDED_ON the backend and FAILURE how it failed there.
"""

import pytest

from conformance.repro.replay import replay
from conformance.repro.scenario import parse

CHECK = {check}
RECORDED_ON = {backend}
FAILURE = {failure}
SCENARIO = (
{literal}
)


def test_{name}(specgate_backend):
    divergence = replay(parse(SCENARIO, {source}), specgate_backend)
    if divergence is not None:
        pytest.fail(f"on backend {{specgate_backend.name!r}}: " + divergence.describe(),
                    pytrace=False)
'''


def _literal(text: str) -> str:
    """The JSON as Python string literals, one per line (``repr`` makes each one: no text of
    the file ever reaches the module as code)."""
    return "\n".join(f"    {line!r}" for line in text.splitlines(keepends=True))


def _one_line(text: str, width: int = 200) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[:width - 3] + "..."


def emit_pytest(scenario: Scenario, module: str) -> str:
    """The module's source; ``module``: its file name (``test_<word characters>.py``, checked
    by the command), for the docstring's command. Every field of the file enters the source as
    a ``repr`` literal, and the test's name keeps ASCII letters and digits only."""
    if not MODULE_NAME.fullmatch(module):
        raise ValueError(f"{module!r}: a module name must match {MODULE_NAME.pattern}")
    check = (scenario.check or "scenario").replace(".py::", "_")
    name = re.sub(r"[^A-Za-z0-9]+", "_", check).strip("_").lower().removeprefix("test_")[:80]
    return TEMPLATE.format(
        check=repr(scenario.check or "(not recorded)"),
        backend=repr(scenario.backend or "(not recorded)"),
        failure=repr(_one_line(scenario.failure or "(not recorded)")),
        module=module, actions=scenario.action_count, runs=len(scenario.runs),
        literal=_literal(to_json(scenario)), name=name or "scenario",
        source=repr(f"{module}: SCENARIO"))
