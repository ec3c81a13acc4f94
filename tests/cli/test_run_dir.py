"""A refused run takes back what it created, and nothing another run writes meanwhile under the same root."""
from __future__ import annotations

from mptrain.cli.run_dir import RunFiles


def _touch(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x")


def test_removes_the_runs_own_folder_and_the_empty_folders_it_made(tmp_path):
    _touch(tmp_path / "lightning_logs" / "version_0" / "config.yaml")  # an earlier run: kept
    files = RunFiles([str(tmp_path)])
    own = tmp_path / "lightning_logs" / "version_1"
    _touch(own / "config.yaml")
    _touch(own / "checkpoints" / "x.ckpt")
    removed = files.remove_new([str(own)])
    assert not own.exists() and (tmp_path / "lightning_logs" / "version_0" / "config.yaml").exists()
    assert str(own / "config.yaml") in removed


def test_another_runs_files_written_meanwhile_are_kept(tmp_path):
    files = RunFiles([str(tmp_path)])
    own = tmp_path / "lightning_logs" / "version_0"
    other = tmp_path / "lightning_logs" / "version_1"
    _touch(own / "config.yaml")
    _touch(other / "metrics.csv")  # a concurrent run under the same root
    (tmp_path / "lightning_logs" / "version_2").mkdir()  # one that has only made its folder yet
    files.remove_new([str(own)])
    assert not own.exists()
    assert (other / "metrics.csv").exists() and (tmp_path / "lightning_logs" / "version_2").is_dir()
    assert (tmp_path / "lightning_logs").is_dir()  # not empty: kept


def test_wandb_run_folders_are_matched_by_the_runs_id(tmp_path):
    files = RunFiles([str(tmp_path)])
    mine = tmp_path / "wandb" / "offline-run-20261207_050000-abc123"
    theirs = tmp_path / "wandb" / "offline-run-20261207_050001-zzz999"
    _touch(mine / "files" / "config.yaml")
    _touch(theirs / "files" / "config.yaml")
    files.remove_new([], ["abc123"])
    assert not mine.exists() and theirs.exists()


def test_nothing_is_removed_when_the_roots_were_too_large_to_scan(tmp_path):
    for i in range(5):
        _touch(tmp_path / f"f{i}")
    files = RunFiles([str(tmp_path)], limit=3)
    _touch(tmp_path / "own" / "new")
    assert files.remove_new([str(tmp_path / "own")]) == [] and (tmp_path / "own" / "new").exists()
