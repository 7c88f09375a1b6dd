"""A seeded per-epoch order over a dataset with an explicit, checkpointable position.

Every dataset in this package walks its items through an ``EpochOrder``: epoch ``e`` visits the
items in ``permutation(seed, e)`` order (or file order without shuffling), and the position is
the pair ``(epoch, index)`` of the next item to hand out. ``state_dict()`` saves that pair (plus
the seed and size it is only valid for); ``load_state_dict()`` on a fresh instance makes the next
item exactly the one an uninterrupted run would have produced.
"""

import numpy as np

_STATE_KEYS = ("epoch", "index", "seed", "num_items", "shuffle")


class EpochOrder:
    """Order over ``num_items`` items, reshuffled each epoch from ``seed``; ``None`` items = an
    unbounded stream (epoch stays 0, the index is the item)."""

    def __init__(self, num_items: int | None, seed: int = 0, shuffle: bool = True,
                 seed_flag: str = "--seed"):
        if num_items is not None and num_items < 1:
            raise ValueError(f"a dataset needs at least one item, got {num_items}")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"{seed_flag} must be a non-negative integer, got {seed!r}")
        self.num_items = num_items
        self.seed = seed
        self.shuffle = shuffle
        self.seed_flag = seed_flag
        self.epoch = 0
        self.index = 0
        self._cached_epoch = None
        self._cached_order = None

    def _order(self, epoch: int) -> np.ndarray:
        if self._cached_epoch != epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_items)
            else:
                order = np.arange(self.num_items)
            self._cached_epoch, self._cached_order = epoch, order
        return self._cached_order

    def item_at(self, epoch: int, index: int) -> int:
        """The item visited at ``index`` of ``epoch``."""
        if self.num_items is None:
            return index
        return int(self._order(epoch)[index])

    def advance(self) -> int:
        """Return the item at the current position and move past it (rolling into the next
        epoch after the last item)."""
        item = self.item_at(self.epoch, self.index)
        self.index += 1
        if self.num_items is not None and self.index == self.num_items:
            self.epoch, self.index = self.epoch + 1, 0
        return item

    def state_dict(self) -> dict:
        """The position of the next item, with the seed and size it is valid for."""
        return dict(epoch=self.epoch, index=self.index, seed=self.seed,
                    num_items=self.num_items, shuffle=self.shuffle)

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; refuses one saved for another size, seed or order."""
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"data position state lacks {', '.join(missing)}")
        if state["num_items"] != self.num_items:
            raise ValueError(f"data position was saved for {state['num_items']} items, "
                             f"this dataset has {self.num_items}")
        if state["seed"] != self.seed:
            raise ValueError(f"data position was saved with {self.seed_flag} {state['seed']}, "
                             f"this run uses {self.seed_flag} {self.seed}")
        if bool(state["shuffle"]) != self.shuffle:
            raise ValueError(f"data position was saved with shuffle={state['shuffle']}, "
                             f"this run uses shuffle={self.shuffle}")
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or index < 0 or (self.num_items is not None and index >= self.num_items):
            raise ValueError(f"data position (epoch {epoch}, index {index}) is out of range "
                             f"for {self.num_items} items")
        self.epoch, self.index = epoch, index


class PositionedDataset:
    """Base for the datasets here: ``next(dataset)`` hands out items in ``EpochOrder`` order,
    forever (epoch after epoch); ``state_dict()``/``load_state_dict()`` save and restore the
    position. Subclasses set ``self.order`` and implement ``__getitem__`` (file order)."""

    order: EpochOrder

    def __getitem__(self, i: int):
        raise NotImplementedError

    def __iter__(self):
        return self

    def __next__(self):
        # Read first, then advance: an item that fails to load leaves the position on it.
        item = self[self.order.item_at(self.order.epoch, self.order.index)]
        self.order.advance()
        return item

    @property
    def epoch(self) -> int:
        """Epoch of the next item."""
        return self.order.epoch

    @property
    def index(self) -> int:
        """Index within the epoch of the next item."""
        return self.order.index

    def state_dict(self) -> dict:
        """Checkpointable position: ``{"epoch", "index", "seed", "num_items", "shuffle"}``."""
        return self.order.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume so that the next item is the one after the saved position."""
        self.order.load_state_dict(state)
