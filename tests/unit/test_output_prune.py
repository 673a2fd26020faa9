"""A session's spilled output is bounded: the oldest turns' files go first, the newest stays."""

from __future__ import annotations

from pathlib import Path

from trio_agentd._output import missing_output, prune


def _file(d: Path, name: str, size: int) -> None:
    (d / name).write_bytes(b"x" * size)


def test_the_oldest_turns_go_first_until_the_rest_fits(tmp_path: Path) -> None:
    for turn in (1, 2, 3, 10):
        _file(tmp_path, f"{turn}.out", 100)
    _file(tmp_path, "2.err", 50)
    _file(tmp_path, "notes.txt", 1000)  # not a turn's: never counted, never removed
    assert prune(tmp_path, budget=250, keep={"10.out"}) == ["1.out", "2.err", "2.out"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["10.out", "3.out", "notes.txt"]
    assert prune(tmp_path, budget=250, keep={"10.out"}) == []  # (numeric order: 3 before 10)


def test_the_turn_kept_stays_whatever_its_size(tmp_path: Path) -> None:
    _file(tmp_path, "1.out", 10)
    _file(tmp_path, "2.out", 1000)
    assert prune(tmp_path, budget=100, keep={"2.out", "2.err"}) == ["1.out"]
    assert (tmp_path / "2.out").exists()
    assert prune(tmp_path / "missing", budget=0, keep=()) == []


def test_a_result_whose_file_went_is_told_apart(tmp_path: Path) -> None:
    _file(tmp_path, "1.out", 10)
    kept = {"output": str(tmp_path / "1.out"), "bytes": 10, "stderr": "", "stderr_bytes": 0}
    assert missing_output(kept) is None
    assert missing_output({"reply": "inline", "bytes": 6}) is None
    gone = {"reply": "", "bytes": 0, "stderr_output": str(tmp_path / "1.err"),
            "stderr_bytes": 5}
    assert missing_output(gone) == str(tmp_path / "1.err")
