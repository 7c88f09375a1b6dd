"""How a run is spread over GPUs (the ``parallelism`` flag group) and Megatron's model-parallel sizes."""

from dataclasses import dataclass
from typing import ClassVar

from megatron_longstraw.config.node import ConfigNode

_SIZE_FLAGS = (("tensor", "--tensor-model-parallel-size"), ("context", "--context-parallel-size"),
               ("expert", "--expert-model-parallel-size"), ("pipeline", "--pipeline-model-parallel-size"),
               ("virtual_pipeline", "--num-virtual-stages-per-pipeline-rank"))


@dataclass(frozen=True)
class ParallelSizes:
    """Model-parallel sizes; data parallelism is the world size divided by their product."""

    tensor: int = 1
    context: int = 1
    expert: int = 1
    pipeline: int = 1
    virtual_pipeline: int = 1  # model chunks per pipeline rank (Megatron's interleaved schedule)

    def check_each(self) -> None:
        """``ValueError`` naming the flag of a size below 1."""
        for name, flag in _SIZE_FLAGS:
            if getattr(self, name) < 1:
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")

    def check(self) -> None:
        """``ValueError`` naming the flag of a size below 1, or virtual stages without PP."""
        self.check_each()
        if self.virtual_pipeline > 1 and self.pipeline == 1:
            raise ValueError(f"--num-virtual-stages-per-pipeline-rank {self.virtual_pipeline} needs "
                             "--pipeline-model-parallel-size > 1")

    def validate(self, world_size: int) -> int:
        """Check the sizes against ``world_size``; returns the data-parallel size."""
        self.check()
        dense = self.tensor * self.context * self.pipeline
        if world_size % dense:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor ({self.tensor}) x context "
                f"({self.context}) x pipeline ({self.pipeline}) parallel sizes = {dense}"
            )
        data = world_size // dense
        if (data * self.context) % self.expert:
            raise ValueError(
                f"--expert-model-parallel-size {self.expert} must divide data x context parallel "
                f"size {data * self.context} (world size {world_size})"
            )
        return data


@dataclass(frozen=True)
class ParallelConfig(ConfigNode):
    """Megatron's parallel layout; data parallelism takes the GPUs left."""

    TITLE: ClassVar[str] = "parallelism"

    tensor_model_parallel_size: int = 1
    """TP: ranks that split each layer's weights and heads."""

    context_parallel_size: int = 1
    """CP: ranks that split each prompt's positions (pages stay, queries travel)."""

    expert_model_parallel_size: int = 1
    """EP: ranks that split the MoE experts."""

    pipeline_model_parallel_size: int = 1
    """PP: pipeline stages, each a run of consecutive layers."""

    num_virtual_stages_per_pipeline_rank: int = 1
    """Model chunks per pipeline rank (Megatron's interleaved schedule)."""

    sequence_parallel: bool = False
    """With TP: split the activations outside attention and MLP over the sequence."""

    use_distributed_optimizer: bool = False
    """Shard the optimizer state over the data-parallel ranks (Megatron's distributed optimizer)."""

    def check(self) -> None:
        self.sizes.check()

    @property
    def sizes(self) -> ParallelSizes:
        """Megatron's model-parallel sizes."""
        return ParallelSizes(self.tensor_model_parallel_size, self.context_parallel_size,
                             self.expert_model_parallel_size, self.pipeline_model_parallel_size,
                             self.num_virtual_stages_per_pipeline_rank)
