"""The Trainer's stop checkpoints, ``hpc_ckpt_<N>.ckpt`` as Lightning names them: where, the newest, how many stay."""

from __future__ import annotations

import re
from typing import Any

from fsspec.core import url_to_fs

from ddp_sigterm._core.log import logger
from ddp_sigterm._lightning.settings import TrainerSettings

KEY = "ddp_sigterm"  # a stop checkpoint's entry of the package's own (Lightning ignores it)

_NAME = re.compile(r"hpc_ckpt_(\d+)\.ckpt")


def is_one(path: object) -> bool:
    return path is not None and _NAME.fullmatch(str(path).rstrip("/").rsplit("/", 1)[-1]) is not None


def saved(directory: str) -> list[str]:
    """The stop checkpoints in ``directory`` (a path or URL, as given), oldest (lowest ``N``) first."""
    fs, root = url_to_fs(directory)
    fs.invalidate_cache(root)  # another process (a previous attempt, another rank) wrote there
    if not fs.isdir(root):
        return []
    names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(root, detail=False)]
    numbered = sorted((int(match.group(1)), name) for name in names if (match := _NAME.fullmatch(name)))
    return [f"{directory.rstrip('/')}/{name}" for _, name in numbered]


def newest(directory: str) -> str | None:
    found = saved(directory)
    return found[-1] if found else None


def keep_newest(directory: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` stop checkpoints of ``directory`` (0: keep all); returns those deleted."""
    if keep <= 0:
        return []
    fs, _ = url_to_fs(directory)
    deleted = []
    for path in saved(directory)[:-keep]:
        try:
            fs.rm(url_to_fs(path)[1], recursive=True)
        except Exception as error:  # the stop succeeded: an old file left behind is worth a warning, no more
            logger.warning("could not delete the old stop checkpoint %s: %s: %s", path, type(error).__name__, error)
        else:
            deleted.append(path)
    if deleted:
        logger.info("deleted %d old stop checkpoint(s), keeping the newest %d: %s", len(deleted), keep,
                    ", ".join(deleted))
    return deleted


def directory(trainer: Any, settings: TrainerSettings) -> str:
    return settings.checkpoint_dir or str(trainer.default_root_dir)


def newest_on_every_rank(trainer: Any, settings: TrainerSettings) -> str | None:
    """Global rank 0's newest stop checkpoint, on every rank (a collective: every rank resumes from the same one)."""
    found = newest(directory(trainer, settings)) if trainer.is_global_zero else None
    chosen: str | None = trainer.strategy.broadcast(found, src=0)
    if chosen is not None:
        logger.info("rank %d of %d: fit started without ckpt_path resumes from the newest stop checkpoint, %s "
                    "(DDP_SIGTERM_RESUME)", trainer.global_rank, trainer.world_size, chosen)
    return chosen
