"""Phase inputs: filter/merge keep every per-request tensor together; idle inputs are well
typed; the draft state follows the batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refengine.speculative.draft_state import DraftState
from refengine.speculative.inputs import DraftExtendInput, DraftInput, VerifyInput

K, H = 3, 5


def tagged(rows: list[int]) -> DraftInput:
    """Every tensor carries its request's tag, so misaligned rows are visible."""
    t = torch.tensor(rows, dtype=torch.int64)
    return DraftInput(topk_p=t[:, None].float().expand(-1, K).clone(),
                      topk_index=t[:, None].expand(-1, K).clone(),
                      hidden_states=t[:, None].float().expand(-1, H).clone(), verified_id=t)


def tags(d: DraftInput) -> list[list[int]]:
    return [d.verified_id.tolist(), d.topk_index[:, 0].tolist(),
            d.topk_p[:, 0].long().tolist(), d.hidden_states[:, 0].long().tolist()]


def test_idle_shapes_and_dtypes() -> None:
    idle = DraftInput.idle(K, H, torch.float32, "cpu")
    assert idle.topk_p.shape == (0, K) and idle.topk_p.dtype == torch.float32
    assert idle.topk_index.shape == (0, K) and idle.topk_index.dtype == torch.int64
    assert idle.hidden_states.shape == (0, H) and idle.verified_id.shape == (0,)
    merged = idle.merge_batch(tagged([7, 8]))
    assert tags(merged) == [[7, 8]] * 4
    assert idle.filter_batch(torch.empty(0, dtype=torch.int64)).batch_size == 0
    assert VerifyInput.idle(4, "cpu").draft_tokens.shape == (0, 4)


def test_verify_input_has_no_filter_or_merge() -> None:
    """All-finish-in-verify: only draft-phase inputs follow the batch."""
    assert not hasattr(VerifyInput, "merge_batch") and not hasattr(VerifyInput, "filter_batch")


def test_rows_must_agree() -> None:
    with pytest.raises(ValueError, match=r"disagree on the row count.*'topk_p': 1"):
        DraftInput(torch.zeros(1, K), torch.zeros(2, K, dtype=torch.int64), torch.zeros(2, H),
                   torch.zeros(2, dtype=torch.int64))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 99), min_size=0, max_size=8, unique=True), st.data())
def test_filter_and_merge_keep_rows_together(rows: list[int], data: st.DataObject) -> None:
    d = tagged(rows)
    keep = data.draw(st.lists(st.integers(0, max(len(rows) - 1, 0)), max_size=len(rows),
                              unique=True)) if rows else []
    filtered = d.filter_batch(torch.tensor(keep, dtype=torch.int64))
    assert tags(filtered) == [[rows[i] for i in keep]] * 4
    other = data.draw(st.lists(st.integers(100, 199), max_size=4, unique=True))
    assert tags(filtered.merge_batch(tagged(other))) == [[rows[i] for i in keep] + other] * 4


def test_draft_extend_input_filters_ragged_rows() -> None:
    lens = torch.tensor([2, 1, 3])
    ids = torch.tensor([10, 11, 20, 30, 31, 32])
    ext = DraftExtendInput(ids[:, None].float().expand(-1, H).clone(), ids, lens)
    kept = ext.filter_batch(torch.tensor([2, 0]))
    assert kept.input_ids.tolist() == [30, 31, 32, 10, 11]
    assert kept.accept_lens.tolist() == [3, 2]
    assert kept.hidden_states[:, 0].long().tolist() == [30, 31, 32, 10, 11]
    with pytest.raises(ValueError):
        DraftExtendInput(torch.zeros(2, H), torch.zeros(2, dtype=torch.int64), torch.tensor([3]))


def test_draft_state_follows_the_batch() -> None:
    state = DraftState(DraftInput.idle(K, H, torch.float32, "cpu"))
    state.add(["a", "b", "c"], tagged([1, 2, 3]))
    state.drop("b")                                   # a middle request leaves
    assert state.rids == ["a", "c"] and tags(state.draft_input)[0] == [1, 3]
    state.add(["d"], tagged([4]))
    assert tags(state.aligned(["d", "a"]))[0] == [4, 1]
    with pytest.raises(RuntimeError, match="no row"):
        state.aligned(["zzz"])
