"""``--shard I/N``: the split is balanced by recorded durations, deterministic, covers every
check exactly once, and a bad shard spec is one line, exit 2, nothing written."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from conformance.run.shard import DURATIONS, Shard, assign, load_durations, parse_shard, weights
from tests.test_cli import assert_usage_error, run


def test_parse_shard() -> None:
    assert parse_shard("1/2") == Shard(1, 2) and str(parse_shard(" 3 / 3 ")) == "3/3"


@pytest.mark.parametrize("text", ["0/2", "3/2", "a/b", "1/0", "1", "-1/2", "1/2/3", ""])
def test_bad_shard_specs_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="expected I/N"):
        parse_shard(text)


def test_longest_first_onto_the_least_loaded_shard() -> None:
    seconds = {"a": 5.0, "b": 4.0, "c": 3.0, "d": 3.0, "e": 2.0, "f": 2.0, "g": 1.0}
    placed = assign(list(seconds), seconds, 2)
    loads = [sum(s for n, s in seconds.items() if placed[n] == shard) for shard in (0, 1)]
    # a -> 0, b -> 1, c -> 1 (4 < 5), d -> 0, e -> 1 (7 < 8), f -> 0 (8 < 9), g -> 1 (9 < 10)
    assert [n for n in seconds if placed[n] == 0] == ["a", "d", "f"]
    assert loads == [10.0, 10.0]


def test_the_split_is_deterministic_whatever_the_order() -> None:
    ids = [f"test_x.py::t[{i}]" for i in range(40)]
    seconds = {n: float(i % 7) for i, n in enumerate(ids)}
    first = assign(ids, seconds, 3)
    shuffled = ids[:]
    random.Random(1).shuffle(shuffled)
    assert assign(shuffled, seconds, 3) == first
    assert set(first) == set(ids) and set(first.values()) == {0, 1, 2}


def test_zero_durations_and_gated_checks_spread_by_count() -> None:
    ids = [f"t.py::c{i}" for i in range(6)]
    gated = frozenset(ids[4:])
    placed = assign(ids, dict.fromkeys(ids, 0.0), 2, gated)
    assert sorted(placed.values()) == [0, 0, 0, 1, 1, 1]
    # checks that will run are placed first: each shard gets one of them before any gated one
    assert {placed[n] for n in ids[:2]} == {0, 1}


def test_unknown_checks_weigh_the_median() -> None:
    table = {"none": {"a": 1.0, "b": 3.0, "c": 10.0}, "eagle": {"x": 7.0}}
    assert weights(["a", "z"], "none", table) == {"a": 1.0, "z": 3.0}
    assert weights(["z"], "mtp", table) == {"z": 5.0}  # no entry for the spec: every entry's
    assert weights(["z"], "none", {}) == {"z": 1.0}


def test_the_bundled_table_covers_every_spec() -> None:
    from conformance.plan.specs import SPECS

    table = load_durations(DURATIONS)
    assert set(table) == set(SPECS) and all(len(rows) > 5 for rows in table.values())


def test_a_table_that_is_not_one_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "d.json"
    bad.write_text(json.dumps({"durations": {"none": {"a": "slow"}}}))
    with pytest.raises(ValueError, match="not a durations table"):
        load_durations(bad)


@pytest.mark.parametrize("text", ["0/2", "3/2", "a/b", "1/0"])
def test_a_bad_shard_is_a_usage_error_before_any_work(
        capsys: pytest.CaptureFixture[str], random_model_dir: Path, tmp_path: Path,
        text: str) -> None:
    code, _, err = run(capsys, "certify", "--spec", "none", "--model", str(random_model_dir),
                       "--shard", text, "--report", str(tmp_path / "r"))
    assert_usage_error(code, err, "--shard", text)
    assert list(tmp_path.iterdir()) == []


def test_a_bad_durations_table_is_a_usage_error(capsys: pytest.CaptureFixture[str],
                                                random_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "d.json").write_text("{")
    code, _, err = run(capsys, "certify", "--spec", "none", "--model", str(random_model_dir),
                       "--shard", "1/2", "--durations", str(tmp_path / "d.json"),
                       "--report", str(tmp_path / "r"))
    assert_usage_error(code, err, "--durations", "not a durations table")
    assert [p.name for p in tmp_path.iterdir()] == ["d.json"]


def test_report_durations_records_a_table(capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    from tests.test_merge import cert_dir

    one = cert_dir(tmp_path / "a", "none", [("t.py::a", "passed", 2.0), ("t.py::b", "failed", 1.0)])
    two = cert_dir(tmp_path / "b", "none", [("t.py::a", "passed", 4.0)])
    code, out, _ = run(capsys, "report", "durations", str(one), str(two),
                       "--out", str(tmp_path / "d.json"))
    assert code == 0 and "none 2" in out
    assert load_durations(tmp_path / "d.json") == {"none": {"t.py::a": 3.0, "t.py::b": 1.0}}
