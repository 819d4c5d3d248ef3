"""A backend written for an older adapter contract keeps certifying through its declared
``contract_version`` (``conformance/contract/versions.py``).

The frozen contract-1 backend (``tests/compat/v1_refengine.py``) certifies; the same backend
without its declaration gets contract 2's ``None`` limits and fails with the ``TypeError`` of
the measured defect (three outside adapters failed 16 checks each after commit 9c29afd), so
the translation is what keeps it working. Unit tests cover the translation, the wrapper's
faithfulness to the wrapped backend's extras and the one-line refusals.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from conformance import adapter
from conformance.contract import CONTRACT_VERSION, Capabilities, OpenConfig, unclaimed_reasons
from conformance.contract.versions import (
    KNOWN_VERSIONS,
    V1_LIMITS,
    ContractRefusal,
    VersionedBackend,
    as_current,
    config_for,
    declared_version,
)
from conformance.plan.registry import BackendError, load_backend
from tests.compat.v1_refengine import V1Backend
from tests.test_cli import assert_usage_error, run

V1 = "tests.compat.v1_refengine:backend"
LIMITS = ("kv_pool_tokens", "page_size", "max_running_requests", "max_prefill_tokens")

# The frozen backend with its declaration removed: every method the same, contract 2 assumed.
UndeclaredV1 = type("UndeclaredV1", (), {k: v for k, v in vars(V1Backend).items()
                                         if k not in ("contract_version", "__dict__",
                                                      "__weakref__")})


def undeclared_v1() -> object:
    return UndeclaredV1()


# --- certify, end to end -------------------------------------------------------------------------

def certify(capsys: pytest.CaptureFixture[str], backend: str, report: Path,
            *model: str) -> tuple[int, str, dict[str, object]]:
    """``specgate certify --spec none`` in this process -> exit code, stdout, report.json."""
    code, out, err = run(capsys, "certify", "--backend", backend, "--spec", "none", "-n", "0",
                         *model, "--report", str(report))
    assert (report / "report.json").exists(), out + err
    return code, out, json.loads((report / "report.json").read_text())


def assert_certified(code: int, out: str, report: dict[str, object], where: Path) -> None:
    assert code == 0, out
    assert "spec none: PASSED" in out and report["status"] == "passed"
    assert report["backend"]["contract_version"] == 1  # type: ignore[index]
    assert "- adapter contract it was written for: `1`" in (where / "report.md").read_text()
    tiers = {t["tier"]: t["counts"] for t in report["tiers"]}  # type: ignore[attr-defined]
    assert all(tiers[t]["passed"] > 0 for t in ("lifecycle", "lossless", "memory", "sessions"))


def test_the_frozen_v1_backend_certifies(capsys: pytest.CaptureFixture[str],
                                         random_model_dir: Path, tmp_path: Path) -> None:
    assert_certified(*certify(capsys, V1, tmp_path, "--model", str(random_model_dir)), tmp_path)


@pytest.mark.slow
def test_the_frozen_v1_backend_certifies_on_the_fixture(capsys: pytest.CaptureFixture[str],
                                                        tmp_path: Path) -> None:
    assert_certified(*certify(capsys, V1, tmp_path), tmp_path)


def test_without_its_declaration_it_fails_as_the_outside_adapters_did(
        capsys: pytest.CaptureFixture[str], random_model_dir: Path, tmp_path: Path) -> None:
    code, out, report = certify(capsys, "tests.test_contract_compat:undeclared_v1", tmp_path,
                                "--model", str(random_model_dir))
    assert code == 1, out
    assert report["backend"]["contract_version"] == CONTRACT_VERSION  # type: ignore[index]
    failures = [f["message"] for t in report["tiers"]  # type: ignore[attr-defined]
                for f in t["failures"]]
    defect = [m for m in failures if m.startswith(
        "TypeError: '<' not supported between instances of 'int' and 'NoneType'")]
    assert len(defect) >= 16, failures


# --- declared versions ---------------------------------------------------------------------------

def test_the_version_is_exported_by_both_names() -> None:
    assert CONTRACT_VERSION == adapter.CONTRACT_VERSION == 2 == max(KNOWN_VERSIONS)
    assert "CONTRACT_VERSION" in adapter.__all__


class Plain:
    name = "plain"
    version = "0"

    def capabilities(self) -> Capabilities:
        return Capabilities()

    def open(self, cfg: OpenConfig) -> object:
        return cfg


def declaring(version: object) -> Plain:
    backend = Plain()
    backend.contract_version = version  # type: ignore[attr-defined]
    return backend


def test_undeclared_means_current_and_current_is_not_wrapped() -> None:
    assert declared_version(Plain()) == CONTRACT_VERSION
    for backend in (Plain(), declaring(2)):
        assert as_current(backend) is backend


@pytest.mark.parametrize("bad", [0, 3, 99, -1, "2", "1", True, False, 1.0, None])
def test_an_unknown_version_is_refused_in_one_line(bad: object) -> None:
    with pytest.raises(ValueError) as err:
        as_current(declaring(bad))
    assert "\n" not in str(err.value) and "contract_version" in str(err.value)
    assert repr(bad) in str(err.value)


def unknown_version() -> Plain:
    return declaring(99)


def test_load_refuses_an_unknown_version() -> None:
    with pytest.raises(BackendError, match="contract_version 99 is not a contract version"):
        load_backend("tests.test_contract_compat:unknown_version")


def test_certify_exits_2_on_an_unknown_version(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    code, _, err = run(capsys, "certify", "--backend", "tests.test_contract_compat:unknown_version",
                       "--spec", "none", "-n", "0", "--report", str(tmp_path / "r"))
    assert_usage_error(code, err, "contract_version 99", "known: 1, 2")
    assert not (tmp_path / "r").exists()


# --- contract 1's OpenConfig ---------------------------------------------------------------------

def test_v1_limits_are_the_pre_re_layout_defaults() -> None:
    """What ``OpenConfig()`` held before commit 9c29afd (``git show
    9c29afd^:conformance/adapter.py``)."""
    assert V1_LIMITS == {"kv_pool_tokens": 16384, "page_size": 1, "max_running_requests": 64,
                         "max_prefill_tokens": 2048}
    assert all(getattr(OpenConfig(), limit) is None for limit in LIMITS)  # contract 2


def test_v1_fills_only_the_limits_left_unset() -> None:
    cfg = OpenConfig(model="m", kv_pool_tokens=96, page_size=4, seed=7, retract_every=3,
                     graph_executor="replay")
    got = config_for(cfg, 1, "x")
    assert (got.kv_pool_tokens, got.page_size) == (96, 4)
    assert (got.max_running_requests, got.max_prefill_tokens) == (64, 2048)
    assert all(getattr(got, f.name) == getattr(cfg, f.name) for f in fields(cfg)
               if f.name not in LIMITS)
    assert config_for(OpenConfig(), 1, "x") == OpenConfig(**V1_LIMITS)
    assert config_for(cfg, 2, "x") is cfg


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_v1_refuses_a_device_in_one_line(device: str) -> None:
    with pytest.raises(ContractRefusal) as err:
        config_for(OpenConfig(device=device), 1, "compat-v1")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("backend 'compat-v1' was written for contract 1, which has no "
                              "OpenConfig.device")
    assert device in message and "--device cpu" in message


# --- the wrapper hides and fakes nothing ---------------------------------------------------------

class Recorder(Plain):
    name = "recorder"
    version = "9.9"
    contract_version = 1

    def __init__(self) -> None:
        self.opened: list[OpenConfig] = []

    def capabilities(self) -> Capabilities:
        return Capabilities(stepwise=True)

    def open(self, cfg: OpenConfig) -> object:
        self.opened.append(cfg)
        return ("handle", cfg)


class WithExtras(Recorder):
    def unclaimed_reasons(self) -> dict[str, str]:
        return {"abort": "no way to stop a request"}

    def kernel_impls(self) -> str:
        return "kernels"


def test_the_wrapper_opens_with_v1_configs_and_returns_the_backends_own_handle() -> None:
    inner = Recorder()
    shim = as_current(inner)
    assert isinstance(shim, VersionedBackend) and isinstance(shim, adapter.Backend)
    assert (shim.name, shim.version, shim.capabilities()) == ("recorder", "9.9",
                                                              inner.capabilities())
    assert declared_version(shim) == 1 and as_current(shim) is shim
    handle = shim.open(OpenConfig(max_running_requests=1))
    assert handle == ("handle", inner.opened[0])
    assert inner.opened[0].max_running_requests == 1 and inner.opened[0].kv_pool_tokens == 16384
    with pytest.raises(ContractRefusal):
        shim.open(OpenConfig(device="cuda"))
    assert len(inner.opened) == 1


def test_the_wrapper_keeps_extras_and_invents_none() -> None:
    bare, rich = as_current(Recorder()), as_current(WithExtras())
    for extra in ("unclaimed_reasons", "kernel_impls", "engine_class", "worker_hooks"):
        assert not hasattr(bare, extra), extra
    assert getattr(bare, "kernel_impls", None) is None
    assert unclaimed_reasons(bare) == {}
    assert rich.kernel_impls() == "kernels"  # type: ignore[attr-defined]
    assert unclaimed_reasons(rich) == {"abort": "no way to stop a request"}


def test_the_registry_wraps_the_frozen_backend() -> None:
    loaded = load_backend(V1)
    assert isinstance(loaded, VersionedBackend) and isinstance(loaded.wrapped, V1Backend)
    assert unclaimed_reasons(loaded) == V1Backend().unclaimed_reasons()
    assert getattr(loaded, "kernel_impls", None) is None
    assert not isinstance(load_backend("tests.test_contract_compat:undeclared_v1"),
                          VersionedBackend)


def test_certify_refuses_a_v1_backend_on_a_device_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # this machine may have no CUDA device: the device check is not what this test is about
    monkeypatch.setattr("conformance.plan.device.device_problem", lambda *a: None)
    code, _, err = run(capsys, "certify", "--backend", V1, "--spec", "none", "--device",
                       "cuda", "--report", str(tmp_path / "r"))
    assert_usage_error(code, err, "written for contract 1", "--device cpu")
    assert not (tmp_path / "r").exists()
