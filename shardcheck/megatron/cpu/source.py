"""Which megatron-core an audit runs: the one ``import megatron.core`` finds, or a source tree.

:func:`use_tree` puts a Megatron-LM checkout (or any folder holding ``megatron/core``) first on
``sys.path``, and on ``PYTHONPATH`` for the processes an audit starts (torchrun scripts),
before megatron is imported: the ranks are forked from this process and run the same code.
:func:`describe` says what was audited: the version, the folder, and for a folder inside a git
work tree its commit and whether its tracked files differ from it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path


class SourceError(ValueError):
    """A ``--megatron`` folder that cannot be audited; the message is one line for the user."""


@dataclass(frozen=True)
class MegatronSource:
    """The audited megatron-core: version, the folder that holds ``megatron/core``, git state."""

    version: str
    path: str
    tree: bool  # given with --megatron (a source tree), not the installed package
    git_commit: str | None = None
    git_dirty: bool | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        """One line: ``megatron-core 0.19.2 at PATH (git 1a2b3c4d5e6f, clean)``."""
        where = f"megatron-core {self.version} at {self.path}"
        if self.git_commit:
            where += f" (git {self.git_commit[:12]}, {'dirty' if self.git_dirty else 'clean'})"
        return where + ("" if self.tree else " (installed)")


def tree_root(path: str | Path) -> Path:
    """The folder holding ``megatron/core`` for a ``--megatron`` argument; SourceError if none."""
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise SourceError(f"--megatron {path}: no such folder")
    if root.name == "core" and root.parent.name == "megatron":  # given megatron/core itself
        root = root.parent.parent
    if not (root / "megatron" / "core" / "__init__.py").is_file():
        raise SourceError(f"--megatron {path}: not a megatron tree (no megatron/core/__init__.py in it)")
    return root


def use_tree(path: str | Path) -> Path:
    """Make ``import megatron.core`` find the tree at ``path`` here and in child processes."""
    root = tree_root(path)
    loaded = sys.modules.get("megatron.core")
    if loaded is not None and not _inside(loaded, root):
        raise SourceError(f"--megatron {path}: another megatron-core is already imported "
                          f"({Path(loaded.__file__).parent})")
    sys.path.insert(0, str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(root), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    import megatron.core

    if not _inside(megatron.core, root):
        raise SourceError(f"--megatron {path}: Python imports megatron.core from "
                          f"{Path(megatron.core.__file__).parent} instead (a megatron/__init__.py "
                          "there takes precedence)")
    return root


def _inside(module, root: Path) -> bool:
    return Path(module.__file__).resolve().is_relative_to(root)


def describe(tree: bool = False) -> MegatronSource:
    """What ``import megatron.core`` gives in this process (imported here if not yet); the git
    state only for a ``tree`` (an installed package may sit inside an unrelated work tree)."""
    import megatron.core

    root = Path(megatron.core.__file__).resolve().parent.parent.parent
    commit, dirty = _git_state(root) if tree else (None, None)
    return MegatronSource(_version(megatron.core, tree), str(root), tree, commit, dirty)


def _version(core, tree: bool) -> str:
    """The release; megatron-core appends the commit of whatever git work tree it sits in
    (``0.19.2+a64758e``), which for an installed package is not its own: dropped there."""
    version = getattr(core, "__version__", None)
    if version is None:
        from megatron.core import package_info

        version = package_info.__version__
    return str(version) if tree else str(version).split("+")[0]


def _git_state(root: Path) -> tuple[str | None, bool | None]:
    """HEAD and whether tracked files under ``root`` differ from it, when ``root`` is in a git
    work tree; (None, None) otherwise."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                                  timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    if git("rev-parse", "--is-inside-work-tree") != "true":
        return None, None
    commit = git("rev-parse", "HEAD")
    changes = git("status", "--porcelain", "--untracked-files=no", "--", "megatron/core")
    return commit, None if changes is None else bool(changes)
