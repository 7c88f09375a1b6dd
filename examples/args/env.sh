# The interpreter of the launch scripts, sourced by them from the repository's root:
#   PYTHON    the project's environment: the python that scripts/setup_env.sh prints (it creates or
#             reuses .venv, or LONGSTRAW_VENV, and returns at once when that is set up; run it once
#             before a multi-node launch); set PYTHON to run another interpreter
#   TORCHRUN  torch's launcher from that interpreter, so every process it starts runs in the same
#             environment: "$PYTHON" -m torch.distributed.run
PYTHON=${PYTHON:-$(bash "$(dirname "${BASH_SOURCE[0]}")/../../scripts/setup_env.sh")}
TORCHRUN=("$PYTHON" -m torch.distributed.run)
