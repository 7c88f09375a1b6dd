"""Megatron's synchronous ``torch_dist`` save starts no process.

Megatron's file writer (``filesystem_async.FileSystemWriterAsync``) returns its write results
through ``get_write_results_queue()``: a queue served by a ``multiprocessing`` manager, a process
spawned at the first save (it re-imports the trainer's modules) and kept, with its resource
tracker, until the trainer exits; a trainer killed with SIGKILL leaves both running, orphaned.
A synchronous save (``TorchDistSaveShardedStrategy.save``: ``dist_checkpointing.save`` without
``async_sharded_save``) writes and reads back its results in this process, so while it runs the
queue is an in-process ``queue.Queue``: nothing is spawned, nothing outlives the trainer, and the
first save skips the manager's start-up. Async saves (``async_save``) are unchanged.
"""

import queue

from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

_ORIGINAL_SAVE = TorchDistSaveShardedStrategy.save


def _in_process_queue(mp_mode: str = "spawn") -> queue.Queue:
    return queue.Queue()


def _save(self, sharded_state_dict, checkpoint_dir):
    """Megatron's synchronous save with the write results kept in this process."""
    shared = filesystem_async.get_write_results_queue
    filesystem_async.get_write_results_queue = _in_process_queue
    try:
        return _ORIGINAL_SAVE(self, sharded_state_dict, checkpoint_dir)
    finally:
        filesystem_async.get_write_results_queue = shared


def needed() -> bool:
    """Everywhere: the trainer's and the converter's saves are synchronous."""
    return True


def apply() -> None:
    """Synchronous saves write their results through an in-process queue."""
    TorchDistSaveShardedStrategy.save = _save


def revert() -> None:
    """Restore Megatron's synchronous save (its results through the manager's queue)."""
    TorchDistSaveShardedStrategy.save = _ORIGINAL_SAVE
