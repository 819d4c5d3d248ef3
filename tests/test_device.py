"""``--device`` on a machine without a GPU: the option's validation (one line, exit 2, nothing
written) and how it travels (OpenConfig, the suite's pytest options, the backends). What needs
a CUDA device runs in the GPU checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conformance.contract import OpenConfig, is_device_name
from conformance.plan.device import device_problem
from conformance.plan.run_plan import RunPlan
from conformance.run.suite import SuiteOptions, suite_args
from tests.test_cli import assert_usage_error, run
from tests.test_plugin import plugin_args

pytest_plugins = ["pytester"]


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def one_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_device_names() -> None:
    assert all(is_device_name(n) for n in ("cpu", "cuda", "cuda:0", "cuda:12"))
    assert not any(is_device_name(n) for n in ("gpu", "cuda:", "cuda:-1", "cuda:x", "CPU", 0))
    assert OpenConfig().device == "cpu"
    with pytest.raises(ValueError, match=r"^device: expected cpu, cuda or cuda:N, got 'gpu'$"):
        OpenConfig(device="gpu")


@pytest.mark.usefixtures("no_cuda")
def test_cuda_without_a_cuda_device_is_a_problem() -> None:
    assert device_problem("cpu", None) is None
    assert device_problem("cpu", "replay") is None
    assert device_problem("cuda", None) == ("--device cuda: torch sees no CUDA device "
                                            "(torch.cuda.is_available() is False)")
    assert device_problem("cuda:1", "cuda") is not None
    assert device_problem("cpu", "cuda") == ("--graphs cuda: CUDA graphs need a CUDA device "
                                             "(add --device cuda)")
    assert device_problem("tpu", None) == "--device: expected cpu, cuda or cuda:N, got 'tpu'"


@pytest.mark.usefixtures("one_cuda_device")
def test_a_cuda_device_torch_sees_is_accepted() -> None:
    assert device_problem("cuda", None) is None
    assert device_problem("cuda:0", "cuda") is None
    assert device_problem("cuda:1", None) == "--device cuda:1: torch sees 1 CUDA device(s)"
    assert device_problem("cpu", "cuda") is not None  # CUDA graphs capture on the device used


@pytest.mark.usefixtures("no_cuda")
@pytest.mark.parametrize("argv, needles", [
    (["certify", "--device", "cuda"], ["--device cuda", "no CUDA device"]),
    (["certify", "--device", "cuda:0", "--graphs", "cuda"], ["--device cuda:0"]),
    (["certify", "--graphs", "cuda"], ["--graphs cuda", "add --device cuda"]),
    (["certify", "--device", "gpu"], ["--device", "expected cpu, cuda or cuda:N"]),
    (["bench", "--device", "cuda"], ["--device cuda", "no CUDA device"]),
    (["bench", "--graphs", "cuda"], ["--graphs cuda"]),
    (["mutants", "--device", "cuda", "--only", "bonus_tokens_not_restaged"],
     ["--device cuda", "no CUDA device"]),
])
def test_device_usage_errors_come_before_any_work(capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path, argv: list[str],
                                                  needles: list[str]) -> None:
    report, table = tmp_path / "report", tmp_path / "bench.json"
    extra = {"certify": ["--report", str(report)], "bench": ["--json", str(table)],
             "mutants": []}[argv[0]]
    code, out, err = run(capsys, *argv, *extra)
    assert_usage_error(code, err, *needles)
    assert out == "" and list(tmp_path.iterdir()) == []


def test_the_device_travels_to_the_suite(tmp_path: Path) -> None:
    """The plan reaches the session whole, as one file: the device and executor with it."""
    plan = RunPlan("refengine", ("none",), graph_executor="cuda", device="cuda:1")
    args = suite_args(SuiteOptions(plan), tmp_path / "r.json", None)
    assert RunPlan.load(Path(args[args.index("--specgate-plan") + 1])) == plan
    assert not {"--specgate-device", "--specgate-graphs"} & set(args)


def test_the_plugin_refuses_a_device_it_cannot_use(pytester: pytest.Pytester,
                                                   no_cuda: None) -> None:
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest_inprocess(*plugin_args(), "--specgate-backend", "refengine",
                                          "--specgate-device", "cuda")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--device cuda: torch sees no CUDA device" in result.stderr.str()


def test_refengine_runs_on_the_device_it_is_opened_with() -> None:
    from conformance.backends.refengine import backend
    from refengine.config import EngineConfig

    handle = backend().open(OpenConfig(device="cpu"))
    try:
        config = handle.engine.config
        assert (config.device, config.cuda_graph) == ("cpu", False)
        # unset: the engine's own default for the device
        assert config.graph_executor == EngineConfig(device="cpu").graph_executor == "aot"
    finally:
        handle.close()


@pytest.mark.usefixtures("no_cuda")
def test_hf_and_ctranslate2_refuse_a_device_they_cannot_use() -> None:
    from conformance.backends.ctranslate2.backend import _ct2_device
    from conformance.backends.hf import _torch_device

    assert _torch_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"^device: the hf backend cannot run on 'cuda'"):
        _torch_device("cuda")
    assert _ct2_device("cpu") == ("cpu", 0)
    with pytest.raises(ValueError, match=r"^device: the ctranslate2 backend cannot run on "
                                         r"'cuda:1': this CTranslate2 build sees \d+ CUDA"):
        _ct2_device("cuda:1")


def test_the_oracle_stays_float32_on_the_cpu() -> None:
    from conformance.checks.oracle import ReferenceOracle

    config = ReferenceOracle("tiny-code", expected=None).engine.config
    assert (config.device, config.dtype) == ("cpu", "float32")
