"""Single-file checkpoints (issue 28): completeness from the format alone, versions kept aside and put
back, torn newest checkpoints quarantined, in process with real writers (torch.save, safetensors, pickle)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from supervisor.run.file_versions import FileVersions, FileVersionSettings
from supervisor.layouts import single_file
from supervisor.run.quarantine import quarantine_torn

from hf_builders import hf_step


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"iter_num": seed, "model": {"w": torch.randn(64, 64, generator=g)}, "config": {"lr": 0.1}}


def _cuts(size: int) -> list[int]:
    """Byte counts a killed save may have left: every prefix at the edges, a spread in between."""
    return sorted({0, 1, 2, 7, 8, 9, 30, size // 3, size // 2, size - 22, size - 2, size - 1} - {size})


@pytest.mark.parametrize("writer", ["zip", "legacy", "pickle", "safetensors"])
def test_every_cut_of_a_save_is_torn_and_the_whole_file_is_complete(tmp_path: Path, writer: str) -> None:
    path = tmp_path / ("model.safetensors" if writer == "safetensors" else "ckpt.pt")
    if writer == "zip":
        torch.save(_state(1), path)
    elif writer == "legacy":
        torch.save(_state(1), path, _use_new_zipfile_serialization=False)
    elif writer == "pickle":
        path.write_bytes(pickle.dumps({"iter": 3, "weights": list(range(500))}, protocol=4))
    else:
        from safetensors.torch import save_file

        save_file(_state(1)["model"], str(path))
    whole = path.read_bytes()
    assert single_file.check_file(path).ok, single_file.check_file(path).reason
    for cut in _cuts(len(whole)):
        if writer == "legacy" and cut > len(whole) - 64 * 64 * 4:
            continue  # the legacy format's raw storage bytes are not checked (said in the note)
        path.write_bytes(whole[:cut])
        check = single_file.check_file(path)
        assert not check.ok, f"{writer}: a save cut at byte {cut} of {len(whole)} passed as complete"


def _versions(root: Path, **kw: object) -> FileVersions:
    return FileVersions(root, FileVersionSettings(**kw))  # type: ignore[arg-type]


def test_in_place_rewrites_are_copied_and_a_torn_file_gets_the_newest_back(tmp_path: Path) -> None:
    live = tmp_path / "ckpt.pt"
    versions = _versions(tmp_path, keep=2)
    kept_bytes = []
    for seed in (1, 2, 3):
        with open(live, "wb") as f:  # torch.save over the old file: same inode, rewritten in place
            torch.save(_state(seed), f)
        assert versions.observe() == 1 and versions.observe() == 0  # each version once
        kept_bytes.append(live.read_bytes())
    kept = versions.versions(live)
    assert len(kept) == 2 and kept[0].path.read_bytes() == kept_bytes[-1]  # the newest two, newest first
    assert all(os.stat(v.path).st_nlink == 1 for v in kept)  # copies: the live inode is rewritten in place
    with open(live, "r+b") as f:  # a kill in the middle of the next save
        f.truncate(len(kept_bytes[-1]) // 2)
    assert versions.observe() == 0  # a torn file is never kept
    (done,) = versions.restore()
    assert done.live == live and "truncated" in done.why
    assert live.read_bytes() == kept_bytes[-1]
    assert torch.load(live, weights_only=True)["iter_num"] == 3
    assert versions.restore() == []  # a complete file is never touched


def test_each_save_wakes_the_pass_so_saves_faster_than_it_are_all_kept(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen in CI: PyKEEN saved every ~0.45 s, the pass ran every 0.5 s, and under load an epoch was rewritten
    before a pass saw it whole: a kill then cost two epochs. A save closing the file wakes the pass (real
    inotify), so every version is kept before the next save; the timer (an hour here) plays no part."""
    from supervisor.run import file_versions
    from support.waits import wait_for

    monkeypatch.setattr(file_versions, "PASS_INTERVAL_S", 3600.0)
    live = tmp_path / "ckpt.pt"
    live.write_bytes(b"")
    versions = _versions(tmp_path, keep=2)
    versions.start()
    try:
        for seed in (1, 2, 3, 4):
            with open(live, "wb") as f:  # in place, as torch.save over the old file
                torch.save(_state(seed), f)
            want = live.read_bytes()
            wait_for(lambda: any(v.path.read_bytes() == want for v in versions.versions(live)), 30,
                     f"version {seed} kept")
    finally:
        versions.stop()
    assert versions.kept == 4


def test_a_missing_file_is_put_back_and_a_writer_of_new_inodes_is_linked(tmp_path: Path) -> None:
    live = tmp_path / "ckpt.pt"
    versions = _versions(tmp_path, keep=3)
    for seed in (1, 2):
        tmp = tmp_path / "ckpt.pt.tmp"
        torch.save(_state(seed), tmp)
        os.replace(tmp, live)  # write-then-rename: a new inode per save
        versions.observe()
    newest = versions.versions(live)[0]
    assert os.stat(newest.path).st_ino == os.stat(live).st_ino  # linked, no bytes copied
    live.unlink()
    (done,) = versions.restore()
    assert "missing" in done.why and torch.load(live, weights_only=True)["iter_num"] == 2


def test_the_size_cap_never_removes_the_newest_version(tmp_path: Path) -> None:
    live = tmp_path / "ckpt.pt"
    versions = _versions(tmp_path, keep=5, max_bytes=1)
    for seed in (1, 2, 3):
        with open(live, "wb") as f:
            torch.save(_state(seed), f)
        versions.observe()
    (only,) = versions.versions(live)
    assert only.path.read_bytes() == live.read_bytes()


def test_auto_tracks_single_files_only_where_no_layout_reads_the_directory(tmp_path: Path) -> None:
    torch.save(_state(1), tmp_path / "ckpt.pt")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert _versions(tmp_path).tracked() == [tmp_path / "ckpt.pt"]
    hf_step(tmp_path, 4)  # an HF checkpoint-4 dir: the HF layout reads it, auto leaves the .pt alone
    assert _versions(tmp_path).tracked() == []
    assert _versions(tmp_path, pattern="ckpt.pt", auto=False).tracked() == [tmp_path / "ckpt.pt"]


def test_quarantine_moves_a_torn_newest_single_file_and_keeps_the_complete_one(tmp_path: Path) -> None:
    torch.save(_state(1), tmp_path / "ckpt_100.pt")
    torn = tmp_path / "ckpt_200.pt"
    torch.save(_state(2), torn)
    torn.write_bytes(torn.read_bytes()[:50])
    os.utime(torn, ns=(os.stat(torn).st_mtime_ns + 10**9,) * 2)
    (moved,) = quarantine_torn(tmp_path)
    assert moved.source == torn and (tmp_path / "ckpt_100.pt").exists()
    assert single_file.tracked_files(tmp_path, "") == [tmp_path / "ckpt_100.pt"]  # "newest *.pt wins" sees 100


def test_after_a_rename_save_an_in_place_save_is_copied_again(tmp_path: Path) -> None:
    """A link is made only for a save that made a new inode; a later in-place save is copied (a link
    would be torn with the live file), and a torn version is never put back."""
    live = tmp_path / "ckpt.pt"
    versions = _versions(tmp_path, keep=3)
    torch.save(_state(1), live)
    versions.observe()
    tmp = tmp_path / "new.tmp"
    torch.save(_state(2), tmp)
    os.replace(tmp, live)  # one save by rename: linked
    versions.observe()
    with open(live, "wb") as f:  # then in place again
        torch.save(_state(3), f)
    versions.observe()
    newest = versions.versions(live)[0]
    assert os.stat(newest.path).st_ino != os.stat(live).st_ino
    with open(live, "r+b") as f:  # a kill mid-save tears the live inode, and with it the linked version 2
        f.truncate(100)
    (done,) = versions.restore()
    assert torch.load(live, weights_only=True)["iter_num"] == 3


def test_a_glob_into_hidden_directories_never_takes_rlsups_own_versions(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    torch.save(_state(1), tmp_path / "run" / "ckpt.pt")
    versions = _versions(tmp_path, pattern="**/*.pt", auto=False)
    for _ in range(3):
        versions.observe()
    assert versions.tracked() == [tmp_path / "run" / "ckpt.pt"] and len(versions.versions()) == 1


def test_a_file_the_trainer_rotated_away_is_neither_kept_nor_put_back(tmp_path: Path) -> None:
    versions = _versions(tmp_path, keep=2)
    torch.save(_state(100), tmp_path / "ckpt_100.pt")
    versions.observe()
    torch.save(_state(200), tmp_path / "ckpt_200.pt")
    (tmp_path / "ckpt_100.pt").unlink()  # "keep the newest only": the trainer deletes the older file
    versions.observe()
    assert {v.live.name for v in versions.versions()} == {"ckpt_200.pt"}  # disk bounded by what is live
    assert versions.restore() == [] and not (tmp_path / "ckpt_100.pt").exists()
    fresh = _versions(tmp_path, keep=2)  # a new run after the user removed the checkpoint to start over
    (tmp_path / "ckpt_200.pt").unlink()
    assert fresh.restore() == [] and not (tmp_path / "ckpt_200.pt").exists()


def test_a_crafted_store_entry_never_writes_outside_the_checkpoint_dir(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    victim = tmp_path / "victim.pt"
    victim.write_bytes(b"not a checkpoint, not rlsup's to overwrite")
    store = root / single_file.VERSIONS_DIR
    store.mkdir()
    torch.save(_state(1), store / ("0" * 19 + "1--..%2Fvictim.pt"))
    versions = _versions(root, pattern="*.pt", auto=False)
    assert versions.versions() == [] and versions.restore() == []
    assert victim.read_bytes().startswith(b"not a checkpoint")


def test_a_store_that_cannot_be_made_is_logged_and_the_job_goes_on(tmp_path: Path) -> None:
    torch.save(_state(1), tmp_path / "ckpt.pt")
    (tmp_path / single_file.VERSIONS_DIR).write_text("a file where the store would go")
    assert _versions(tmp_path).observe() == 0  # no exception into the run loop


def test_quarantine_leaves_data_files_beside_checkpoints_alone(tmp_path: Path) -> None:
    torch.save(_state(1), tmp_path / "ckpt.pt")
    (tmp_path / "val.bin").write_bytes(b"\x00\x01" * 100)  # nanoGPT's token ids, newer than the checkpoint
    (tmp_path / "meta.pkl").write_bytes(b"(dp0\n.")  # a protocol-0 pickle
    assert quarantine_torn(tmp_path) == []
    assert _versions(tmp_path).tracked() == [tmp_path / "ckpt.pt"]


def test_litgpt_step_files_are_found_by_auto_read_newest_first_and_never_kept_aside(tmp_path: Path) -> None:
    """litgpt's one file per step directory: found where no top-level file is, newest by mtime, the number in the
    directory's name only a label, the torn newest quarantined as a file (litgpt's ``step-*/*.pth`` then skips
    it), and no version copied (each file is written once)."""
    for i, it in enumerate((10, 20, 30)):
        path = tmp_path / f"step-{it:08d}" / "lit_model.pth"
        path.parent.mkdir()
        torch.save(_state(it), path)
        os.utime(path, (1_000 + i, 1_000 + i))
    (tmp_path / ".hidden-7").mkdir()
    torch.save(_state(7), tmp_path / ".hidden-7" / "x.pt")  # a dot directory is never a step's
    torn = tmp_path / "step-00000030" / "lit_model.pth"
    torn.write_bytes(torn.read_bytes()[:50])
    files = single_file.checkpoint_files(tmp_path, "")
    assert files == [tmp_path / f"step-{it:08d}" / "lit_model.pth" for it in (10, 20, 30)]
    assert single_file.tracked_files(tmp_path, "") == []  # versions: top-level files only
    assert [(r.step, r.valid) for r in single_file.scan(tmp_path, "")] == [(10, True), (20, True), (30, False)]
    assert single_file.latest_valid(tmp_path, "").path == tmp_path / "step-00000020" / "lit_model.pth"
    assert [r.path for r in single_file.torn_newest(tmp_path, "")] == [torn]
    assert single_file.step_in_name(tmp_path, tmp_path / "ckpt.pt") is None
    assert single_file.step_in_name(tmp_path, tmp_path / "ckpt_100.pt") == 100
    torch.save(_state(1), tmp_path / "ckpt.pt")  # a top-level file: it is the checkpoint, step files are not
    assert single_file.checkpoint_files(tmp_path, "") == [tmp_path / "ckpt.pt"]
    (tmp_path / "ckpt.pt").unlink()
    (moved,) = quarantine_torn(tmp_path)
    assert moved.source == torn and moved.target.parent == torn.parent and not torn.exists()
    assert single_file.torn_newest(tmp_path, "") == []
    assert _versions(tmp_path, keep=2).observe() == 0


_FORKS: list[int] = []  # forks of this process while the test below counts them (os.register_at_fork stays)
_COUNTING: list[bool] = []


def _count_fork() -> None:
    if _COUNTING:
        _FORKS.append(1)


os.register_at_fork(before=_count_fork)


