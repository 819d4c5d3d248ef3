"""The checks every command makes before any work: specs, backends, model files."""

from __future__ import annotations

from typing import TYPE_CHECKING

from conformance.plan.usage import UsageError

if TYPE_CHECKING:
    from conformance.contract import Backend


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
