"""Tiers ask only for what they use: a run-to-completion backend with sampling gets the
distribution tier, a backend without pages runs page size 1 only, and every check's docstring
names what it requires."""

from __future__ import annotations

import pytest
from test_plugin import SUITE, plugin_args

from conformance.backends.refengine import RefEngineBackend
from conformance.contract import Capabilities

pytest_plugins = ["pytester"]

# The tiers whose checks document their requirements in their docstrings.
DOCUMENTED = ("test_lossless.py", "test_memory.py", "test_distribution.py")


class SamplesToCompletion(RefEngineBackend):
    """Like the hf backend: sampling, but no stepwise control and no paged pool."""

    name = "samples-to-completion"

    def capabilities(self) -> Capabilities:
        return Capabilities(algorithms=frozenset({"none"}), sampling=True)


def samples_to_completion() -> SamplesToCompletion:
    return SamplesToCompletion()


def collect(pytester: pytest.Pytester, backend: str, spec: str) -> list[pytest.Item]:
    (pytester.path / "none.ini").write_text("[pytest]\n")
    return [item for item in pytester.inline_genitems(
        *(str(SUITE / name) for name in DOCUMENTED), "-c", str(pytester.path / "none.ini"),
        "--rootdir", str(SUITE), "-p", "no:cacheprovider", *plugin_args(),
        "--specgate-backend", backend, "--specgate-spec", spec)[0]]


def not_claimed(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("skip")
    return mark.kwargs["reason"] if mark is not None else None


def requires(item: pytest.Item) -> set[str]:
    return {n for n in dict(item.user_properties)["specgate_requires"].split(",")
            if not n.startswith("algorithm:")}


def test_a_run_to_completion_backend_gets_sampling_certified(pytester: pytest.Pytester) -> None:
    items = collect(pytester, "tests.test_tier_requirements:samples_to_completion", "none")
    gated = {item.nodeid.split("/")[-1]: not_claimed(item) for item in items}
    distribution = {k: v for k, v in gated.items() if k.startswith("test_distribution.py")}
    assert distribution and not any(distribution.values()), distribution
    memory = {k: v for k, v in gated.items() if k.startswith("test_memory.py")}
    assert memory and all(v and "stepwise" in v for v in memory.values()), memory


def test_page_size_4_only_for_a_paged_backend(pytester: pytest.Pytester) -> None:
    items = collect(pytester, "tests.test_tier_requirements:samples_to_completion", "none")
    paged = [i for i in items if "-4]" in i.nodeid and "test_lossless.py" in i.nodeid]
    unpaged = [i for i in items if "-1]" in i.nodeid and "test_lossless.py" in i.nodeid]
    assert paged and all("memory_view" in (not_claimed(i) or "") for i in paged)
    assert unpaged and not any(not_claimed(i) for i in unpaged if "retraction" not in i.nodeid)
    assert all("memory_view" in requires(i) for i in paged)


def test_every_check_names_its_requirements_in_its_docstring(
        pytester: pytest.Pytester) -> None:
    """Module-level requirements may be named in the module docstring instead."""
    items = collect(pytester, "refengine", "eagle")
    assert items
    missing = []
    for item in items:
        doc = (item.function.__doc__ or "") + (item.module.__doc__ or "")
        if "Requires" not in (item.function.__doc__ or ""):
            missing.append(f"{item.nodeid}: no 'Requires' line")
        missing += [f"{item.nodeid}: {cap}" for cap in sorted(requires(item)) if cap not in doc]
    assert not missing, missing
