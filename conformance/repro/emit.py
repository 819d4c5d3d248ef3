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

TEMPLATE = '''"""Regression repro emitted by `specgate repro --emit-pytest`.

Check: {check}
Recorded on backend: {backend}
It failed with: {failure}

Run it with: pytest {module} --specgate-backend <backend>
It replays the scenario below through specgate's adapter: {actions} actions over {runs} engine
instance(s), each then run to completion, checking the invariants after every step, greedy
outputs against the reference, finish reasons, and that each run ends idle.
"""

import pytest

from conformance.repro.replay import replay
from conformance.repro.scenario import parse

SCENARIO = {literal}


def test_{name}(specgate_backend):
    divergence = replay(parse(SCENARIO, {source!r}), specgate_backend)
    if divergence is not None:
        pytest.fail(divergence.describe(), pytrace=False)
'''


def _literal(text: str) -> str:
    """The JSON as a readable raw string literal where it can be one."""
    if '"""' in text or text.endswith('"') or text.endswith("\\"):
        return repr(text)
    return f'r"""{text}"""'


def _one_line(text: str, width: int = 200) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[:width - 3] + "..."


def emit_pytest(scenario: Scenario, module: str) -> str:
    """The module's source; ``module``: its file name, for the docstring's command."""
    check = (scenario.check or "scenario").replace(".py::", "_")
    name = re.sub(r"\W+", "_", check).strip("_").lower().removeprefix("test_")[:80]
    return TEMPLATE.format(
        check=scenario.check or "(not recorded)", backend=scenario.backend or "(not recorded)",
        failure=_one_line(scenario.failure or "(not recorded)").replace('"""', "'''"),
        module=module, actions=scenario.action_count, runs=len(scenario.runs),
        literal=_literal(to_json(scenario)), name=name or "scenario",
        source=f"{module}: SCENARIO")
