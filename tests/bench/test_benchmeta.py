"""bench/benchmeta.py's commit label: what a result says it measured."""
from __future__ import annotations

import subprocess

from bench.benchmeta import git_commit


def _git(repo, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_a_tree_that_differs_from_head_is_labelled_dirty_and_untracked_files_do_not_count(tmp_path, monkeypatch):
    monkeypatch.delenv("PLAB_GIT_COMMIT", raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("a = 1\n")
    _git(tmp_path, "add", "code.py")
    _git(tmp_path, "commit", "-qm", "first")
    sha = _git(tmp_path, "rev-parse", "HEAD")
    (tmp_path / "results.json").write_text("{}")  # untracked: results written by the run itself
    assert git_commit(tmp_path) == sha
    # the GPU machine's copy: files newer than the .git they came with
    (tmp_path / "code.py").write_text("a = 2\n")
    assert git_commit(tmp_path) == sha + "-dirty"
    monkeypatch.setenv("PLAB_GIT_COMMIT", "abc1234")
    assert git_commit(tmp_path) == "abc1234"


def test_outside_a_git_checkout_the_label_is_unknown(tmp_path, monkeypatch):
    monkeypatch.delenv("PLAB_GIT_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert git_commit(tmp_path) == "unknown"
