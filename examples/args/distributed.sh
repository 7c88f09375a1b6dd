# Where this process sits in a multi-node launch, in Megatron-LM's convention, from the
# environment (sourced by the launch scripts):
#   GPUS_PER_NODE  processes on this node (default 8)
#   NNODES         nodes in the job (default 1; under SLURM, SLURM_NNODES)
#   NODE_RANK      this node's index, 0 .. NNODES-1 (default 0; under SLURM, SLURM_NODEID)
#   MASTER_ADDR    address of node 0 (default localhost)
#   MASTER_PORT    a free port on node 0 (default 6000)
# Run the same launch script on every node; examples/slurm/ has the sbatch form.
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
WORLD_SIZE=$((GPUS_PER_NODE * NNODES))
DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
)
