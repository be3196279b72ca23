"""The Trainer's stop checkpoints: where they go, which one a relaunch resumes from, how many stay.

They keep Lightning's name, ``hpc_ckpt_<N>.ckpt`` (``N`` one more than the highest there), so that
``ckpt_path="hpc"`` and Lightning's own resume under SLURM find them in ``default_root_dir``. The
directory may be any fsspec URL, as ``default_root_dir`` may (``TrainerSettings.checkpoint_dir``).
"""

from __future__ import annotations

import re

from fsspec.core import url_to_fs

from ddp_sigterm._core.log import logger

KEY = "ddp_sigterm"
"""A stop checkpoint's entry of the package's own (Lightning loads a checkpoint's other entries and ignores it): the
loggers' runs (:mod:`logger_runs`) and the training data's place (:mod:`loader_positions`)."""

_NAME = re.compile(r"hpc_ckpt_(\d+)\.ckpt")


def is_one(path: object) -> bool:
    """Whether ``path`` (a path or URL, or None) names a stop checkpoint."""
    return path is not None and _NAME.fullmatch(str(path).rstrip("/").rsplit("/", 1)[-1]) is not None


def saved(directory: str) -> list[str]:
    """The stop checkpoints in ``directory``, oldest (lowest ``N``) first, as paths in the form of
    ``directory`` (a URL stays a URL). Empty if the directory does not exist."""
    fs, root = url_to_fs(directory)
    fs.invalidate_cache(root)  # another process (a previous attempt, another rank) wrote there
    if not fs.isdir(root):
        return []
    found = []
    for entry in fs.ls(root, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        match = _NAME.fullmatch(name)
        if match:
            found.append((int(match.group(1)), f"{directory.rstrip('/')}/{name}"))
    return [path for _, path in sorted(found)]


def newest(directory: str) -> str | None:
    """The newest stop checkpoint of ``directory`` (highest ``N``), None if it has none."""
    found = saved(directory)
    return found[-1] if found else None


def keep_newest(directory: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` stop checkpoints of ``directory`` (0: keep all); returns the
    paths deleted. A deletion that fails is logged as a warning: the new checkpoint is saved already."""
    if keep <= 0:
        return []
    fs, _ = url_to_fs(directory)
    deleted = []
    for path in saved(directory)[:-keep]:
        try:
            fs.rm(url_to_fs(path)[1], recursive=True)
        except Exception as error:  # the stop succeeded; an old file left behind is worth a warning, no more
            logger.warning("could not delete the old stop checkpoint %s: %s: %s", path, type(error).__name__, error)
        else:
            deleted.append(path)
    if deleted:
        logger.info("deleted %d old stop checkpoint(s), keeping the newest %d: %s", len(deleted), keep,
                    ", ".join(deleted))
    return deleted
