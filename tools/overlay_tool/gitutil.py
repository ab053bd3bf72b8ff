"""Running git with an environment that makes every commit and export reproducible."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import git as gitpython  # GitPython

from .errors import ExternalError
from .safety import child_kwargs
from .patches import AUTHOR_EMAIL, AUTHOR_NAME, FIXED_DATE

# Options on every git call: the user's global/system config (diff.noprefix, commit.gpgsign,
# core.autocrlf, format.* ...) must not change what the tool writes.
_BASE_CONFIG = [
    "-c", "core.autocrlf=false",
    "-c", "core.safecrlf=false",
    "-c", "core.quotepath=false",
    "-c", "commit.gpgsign=false",
    "-c", "tag.gpgsign=false",
    "-c", "diff.noprefix=false",
    "-c", "diff.mnemonicprefix=false",
    "-c", "advice.detachedHead=false",
]


def git_env(extra: dict[str, str] | None = None, user_config: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("GIT_") and k not in ("GIT_EXEC_PATH",):
            del env[k]
    if not user_config:
        env.update({"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull})
    env.update(
        {
            "GIT_TERMINAL_PROMPT": "0",
            "GIT_AUTHOR_NAME": AUTHOR_NAME,
            "GIT_AUTHOR_EMAIL": AUTHOR_EMAIL,
            "GIT_AUTHOR_DATE": FIXED_DATE,
            "GIT_COMMITTER_NAME": AUTHOR_NAME,
            "GIT_COMMITTER_EMAIL": AUTHOR_EMAIL,
            "GIT_COMMITTER_DATE": FIXED_DATE,
            "LC_ALL": "C",
            "LANG": "C",
        }
    )
    if extra:
        env.update(extra)
    return env


class Git:
    """A git repository (opened with GitPython) and plumbing calls with the reproducible environment."""

    def __init__(self, path: Path):
        try:
            self.repo = gitpython.Repo(path)
        except (gitpython.InvalidGitRepositoryError, gitpython.NoSuchPathError):
            raise ExternalError(f"{path} is not a git repository") from None
        self.git_dir = Path(self.repo.git_dir)
        wt = self.repo.working_tree_dir
        self.worktree = Path(wt) if wt else None

    @classmethod
    def init(cls, path: Path, branch: str) -> "Git":
        path.mkdir(parents=True, exist_ok=True)
        gitpython.Repo.init(path, initial_branch=branch)
        g = cls(path)
        for k, v in (("core.autocrlf", "false"), ("core.fileMode", "true"), ("gc.auto", "0")):
            g.run("config", k, v)
        exclude = g.git_dir / "info" / "exclude"
        exclude.parent.mkdir(parents=True, exist_ok=True)
        exclude.write_text("__pycache__/\n*.pyc\n")
        return g

    def run(
        self,
        *args: str,
        input: bytes | None = None,
        env: dict[str, str] | None = None,
        check: bool = True,
        cwd: Path | None = None,
        user_config: bool = False,
    ) -> subprocess.CompletedProcess:
        cmd = ["git", *_BASE_CONFIG, *args]
        r = subprocess.run(
            cmd,
            cwd=cwd or self.worktree or self.git_dir,
            input=input,
            env=git_env(env, user_config),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            **child_kwargs(),
        )
        if check and r.returncode != 0:
            raise ExternalError(
                f"git {' '.join(args[:3])} failed in {self.worktree or self.git_dir}:\n"
                + r.stderr.decode("utf-8", "replace").strip()
            )
        return r

    def out(self, *args: str, **kw) -> str:
        return self.run(*args, **kw).stdout.decode("utf-8", "replace").strip()

    def rev(self, ref: str) -> str | None:
        r = self.run("rev-parse", "--verify", "--quiet", ref + "^{commit}", check=False)
        return (r.stdout.decode().strip() or None) if r.returncode == 0 else None

    def current_branch(self) -> str | None:
        r = self.run("symbolic-ref", "--quiet", "--short", "HEAD", check=False)
        return r.stdout.decode().strip() if r.returncode == 0 else None

    def status_lines(self) -> list[str]:
        """Uncommitted changes and untracked (not ignored) files."""
        # The user's own config counts here: files they ignore globally are not "their work".
        out = self.run(
            "status", "--porcelain=v1", "--untracked-files=normal", "--ignore-submodules=none", user_config=True
        ).stdout
        return [line for line in out.decode("utf-8", "replace").splitlines() if line]
