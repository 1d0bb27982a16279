"""Checkpoints: atomic rotation, weights-only loading, fallback past a torn file, strategy round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dreamp2p.service.checkpoint import list_checkpoints, load_latest, save_checkpoint


def test_rotation_keeps_the_newest(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        save_checkpoint(tmp_path, step, {"step": step, "w": torch.full((3,), float(step))}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-0000000030.pt", "ckpt-0000000040.pt"]
    loaded = load_latest(tmp_path)
    assert loaded is not None
    path, state = loaded
    assert path.name == "ckpt-0000000040.pt" and state["step"] == 40 and torch.equal(state["w"], torch.full((3,), 40.0))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left behind


def test_torn_newest_falls_back(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, {"step": 1}, keep=3)
    newest = save_checkpoint(tmp_path, 2, {"step": 2}, keep=3)
    newest.write_bytes(newest.read_bytes()[:20])  # a crash mid-write on a filesystem without rename atomicity
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded[1]["step"] == 1


class Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("pwned",))


def test_arbitrary_objects_are_not_unpickled(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ckpt-0000000005.pt"
    torch.save({"step": 5, "x": Evil()}, path)
    assert load_latest(tmp_path) is None  # refused by weights_only loading, never executed
    assert "pwned" not in capsys.readouterr().out


def test_empty_dir(tmp_path: Path) -> None:
    assert load_latest(tmp_path / "missing") is None
    with pytest.raises(ValueError):
        save_checkpoint(tmp_path, 1, {}, keep=0)


@pytest.mark.parametrize(
    ("mine", "others", "want"),
    [
        ([50, 64], [[50, 65], [50, 65]], None),  # the others saved a newer state: join them
        ([50, 65], [[50, 64], [50, 60]], 65),  # ours is the newest: resume from it
        ([50, 64], [[50, 64], [50, 64]], 64),  # stopped together
        ([64], [[]], 64),  # a member without checkpoints joins us
        ([], [[10]], None),
        ([], [[], []], None),  # nobody saved anything: a fresh start
        ([10, 20], [], 20),  # a ring of one
    ],
)
def test_agree_resume_step(mine: list[int], others: list[list[int]], want: int | None) -> None:
    from dreamp2p.service.checkpoint import agree_resume_step

    assert agree_resume_step(mine, others) == want
