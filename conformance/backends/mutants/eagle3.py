"""Mutants of the EAGLE-3 head's math (``refengine/model/eagle3.py``): the target layers it
taps, the order it fuses them in, its draft vocabulary's map onto the target's, the halves of
its doubled input, and the position its draft-extend rows sit at. Each leaves verification
alone, so outputs stay the target's; only what the head drafts changes, which the golden
tier's per-step acceptance shows."""

from __future__ import annotations

from dataclasses import replace

import torch

from conformance.backends.mutants.tables import with_draft
from refengine import Engine
from refengine.model.configs import Eagle3Config
from refengine.model.eagle3 import AuxFeatureTap, Eagle3DraftModel, Eagle3Layer
from refengine.model.llama import ForwardBatch, LlamaForCausalLM
from refengine.model.loader import ModelConfig
from refengine.request import Req
from refengine.runner import ModelRunner
from refengine.speculative.inputs import DraftExtendInput


class _RebuiltHead(Eagle3DraftModel):
    """The EAGLE-3 head with its tap or its layer built from the classes named here (the
    reference ones unless a mutant names a broken one); weights load into them unchanged."""

    tap_class: type[AuxFeatureTap] = AuxFeatureTap
    layer_class: type[Eagle3Layer] = Eagle3Layer

    def __init__(self, cfg: ModelConfig, eagle3: Eagle3Config, target: LlamaForCausalLM
                 ) -> None:
        super().__init__(cfg, eagle3, target)
        self.midlayer = self.layer_class(cfg)
        object.__setattr__(self, "tap", self.tap_class(eagle3.aux_layers, self.fc))


# --- the auxiliary features -------------------------------------------------------------------

class _TapsOneLayerEarly(AuxFeatureTap):
    def __init__(self, layers: tuple[int, ...], fc: torch.nn.Linear) -> None:
        # BUG: id i read as the output of layer i (the convention that counts layer outputs),
        # which is one layer early: the id names the input of layer i, the output of i - 1.
        super().__init__(tuple(i - 1 for i in layers), fc)


class _TapsOneLayerEarlyHead(_RebuiltHead):
    tap_class = _TapsOneLayerEarly


class Eagle3TapsOneLayerEarly(Engine):
    """Wrong auxiliary layers: each of the EAGLE-3 head's taps reads the residual stream one
    layer before the one its id names (the ids read in the other numbering, where id i is
    layer i's output). Shapes line up, output stays lossless; the head drafts from features it
    was not trained on and acceptance drops."""

    draft_classes = with_draft("eagle3", _TapsOneLayerEarlyHead)


class _TapsReversed(AuxFeatureTap):
    def forward(self, taps: list[torch.Tensor]) -> torch.Tensor:
        # BUG: the taps are fused deepest layer first; fc's columns expect ascending order.
        return self.fc(torch.cat(taps[::-1], dim=-1))


class _TapsReversedHead(_RebuiltHead):
    tap_class = _TapsReversed


class Eagle3TapsFusedReversed(Engine):
    """Fused features in the wrong order: the EAGLE-3 head's taps are concatenated deepest
    layer first before ``fc``, whose columns expect ascending layer order (config.json listing
    its layers in another order, taken as given). Lossless; acceptance drops."""

    draft_classes = with_draft("eagle3", _TapsReversedHead)


# --- the draft vocabulary ---------------------------------------------------------------------

class _MapOffByOne(Eagle3DraftModel):
    def target_logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().target_logits(x)
        ids = torch.arange(self.eagle3.draft_vocab_size, device=logits.device) + self.d2t
        # BUG: d2t indexed one off: draft id i's score lands on draft id i+1's target id.
        shifted = logits.clone()
        shifted[:, ids.roll(-1)] = logits[:, ids]
        return shifted


class Eagle3DraftMapOffByOne(Engine):
    """Draft-vocabulary map off by one: the EAGLE-3 head's ``d2t`` is read one draft id off, so
    each draft id's score lands on the target id of the next one. Every drafted token is still
    a draft-vocabulary token and verification is untouched (lossless); acceptance collapses."""

    draft_classes = with_draft("eagle3", _MapOffByOne)


class _OffVocabularyAtZero(Eagle3DraftModel):
    def target_logits(self, x: torch.Tensor) -> torch.Tensor:
        # BUG: ids off the draft vocabulary get logit 0 instead of -inf.
        return super().target_logits(x).nan_to_num(neginf=0.0)


class Eagle3OffVocabularyNotMasked(Engine):
    """Draft-vocabulary mask wrong: target ids the EAGLE-3 head's draft vocabulary lacks get
    logit 0 instead of ``-inf``. A chain's argmax notices only where every draft-vocabulary
    logit is negative, but those ids take probability mass, so a tree's path scores, and the
    nodes it keeps, change. Lossless; acceptance drops."""

    draft_classes = with_draft("eagle3", _OffVocabularyAtZero)


# --- the head's layer -------------------------------------------------------------------------

class _HalvesSwapped(Eagle3Layer):
    def doubled_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # BUG: the feature half first; q/k/v's columns expect the embedding half first.
        return torch.cat([self.hidden_norm(hidden), self.input_layernorm(embeds)], dim=-1)


class _HalvesSwappedHead(_RebuiltHead):
    layer_class = _HalvesSwapped


class Eagle3DoubledInputSwapped(Engine):
    """Wrong half of the doubled input: the EAGLE-3 head's layer attends over ``[feature;
    embedding]`` instead of ``[embedding; feature]`` (both 2H wide, so q/k/v accept it).
    Lossless; acceptance collapses."""

    draft_classes = with_draft("eagle3", _HalvesSwappedHead)


# --- the head's positions ---------------------------------------------------------------------

class _ExtendAtTargetPositions(ModelRunner):
    def prepare_draft_extend(self, reqs: list[Req], accepted: DraftExtendInput, ends: list[int]
                             ) -> ForwardBatch:
        batch = super().prepare_draft_extend(reqs, accepted, ends)
        # BUG: each row sits at its token's target position p+1 (as in the verify block it
        # came from), not at p, the position of the feature it carries.
        return replace(batch, positions=batch.positions + 1)


class Eagle3ExtendAtTargetPositions(Engine):
    """Draft KV at the target's positions: after verify, the head's row carrying accepted token
    x_{p+1} with feature p is rotated at p+1 (the token's position in the verify block)
    instead of p, so its draft KV has the wrong rotary phase beside the prefill's and the draft
    steps'. Lossless; acceptance drops."""

    runner_class = _ExtendAtTargetPositions
