"""Write an output folder atomically: into ``<out>.tmp-<pid>``, renamed into place on success."""

import contextlib
import os
import shutil
from pathlib import Path


@contextlib.contextmanager
def atomic_output(destination: str | Path, overwrite: bool = False, flag: str = "--save"):
    """Yield a temporary folder next to ``destination``; on success it becomes ``destination``.

    Any exception removes the temporary folder (nothing half-written is left). An existing
    ``destination`` is refused unless ``overwrite``; then it is renamed away, the new folder
    renamed in, and the old one deleted.
    """
    destination = Path(destination).absolute()
    if destination.exists() and not overwrite:
        raise ValueError(f"{flag} {destination}: already exists (pass --overwrite to replace it)")
    if not destination.parent.is_dir():
        raise ValueError(f"{flag} {destination}: parent folder does not exist")
    temporary = destination.with_name(f"{destination.name}.tmp-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    try:
        yield temporary
        _fsync_dir(temporary)
        if destination.exists():
            old = destination.with_name(f"{destination.name}.old-{os.getpid()}")
            destination.rename(old)
            temporary.rename(destination)
            shutil.rmtree(old)
        else:
            temporary.rename(destination)
        _fsync_dir(destination.parent)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
