"""The checks every command makes before any work: specs, backends, model files, what a
backend's contract version cannot express, and a backend's refusal of the model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from conformance.plan.usage import UsageError

if TYPE_CHECKING:
    from conformance.contract import Backend, OpenConfig


def validate(spec: str, backends: list[str], model: str, draft_model: str | None = None
             ) -> list[Backend]:
    """Everything a command needs, checked before any work: specs, backends, model files;
    -> the backends, loaded."""
    from conformance.plan.registry import BackendError, load_backend
    from conformance.plan.specs import resolve_specs
    from refengine.data import resolve_model_dir
    from refengine.model.loader import check_draft_dir, check_model_dir

    try:
        drafts = {draft_model} if draft_model else {
            c.draft_model for choice in resolve_specs(spec) for c in choice.configs
            if c and c.needs_draft_model}
        loaded = [load_backend(name, launcher=True) for name in backends]
        check_model_dir(resolve_model_dir(model))
        for draft in sorted(drafts):
            check_draft_dir(resolve_model_dir(draft))
    except (BackendError, ValueError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None
    return loaded


def contract_refusal(backend: Backend, model: str, device: str) -> OpenConfig:
    """The backend's open configuration for ``model`` on ``device`` (every other setting at
    its default) as its contract version defines it; UsageError where that version cannot
    express the run (a device other than the CPU, for contract 1)."""
    from conformance.contract import OpenConfig
    from conformance.contract.versions import ContractRefusal, config_for, declared_version

    try:
        return config_for(OpenConfig(model=model, device=device), declared_version(backend),
                          backend.name)
    except ContractRefusal as err:
        raise UsageError(str(err)) from None


def refuses_model(backend: Backend, cfg: OpenConfig) -> None:
    """Open ``backend`` once on the model with every other setting at its default, before any
    check runs: a model specgate's own checks accept and the backend does not (vLLM refusing an
    architecture, weights its loader cannot read) is then one line and exit 2, not every check
    failing with the same line. The contract lets ``open`` refuse only with ``ValueError``;
    anything else raised here is left for the suite, whose checks report it as the failure it
    is. Mutants are the reference engine, whose loader ``validate`` already ran."""
    try:
        handle = backend.open(cfg)
    except ValueError as err:
        raise UsageError(f"--model {cfg.model}: backend {backend.name!r} refuses it: "
                         f"{str(err).splitlines()[0] if str(err) else type(err).__name__}"
                         ) from None
    except Exception:  # reported by the suite's checks, with their context
        return
    handle.close()
