"""Forward/backward smoke run of the model families on random tokens.

Usage (single process, or under torchrun for TP):
    python examples/smoke_forward_backward.py                       # both tiny debug models
    python examples/smoke_forward_backward.py --model qwen3.5-0.8b --seq-length 32768 --bf16
    torchrun --nproc-per-node 2 examples/smoke_forward_backward.py --tensor-model-parallel-size 2
"""

import argparse
import time

import torch

from megatron_longstraw.config.parallel import ParallelSizes
from megatron_longstraw.distributed import destroy_distributed, device, init_distributed
from megatron_longstraw.models.builder import build_model
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.presets import resolve_hf_config


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="preset name or HF config path (repeatable); "
                        "default: qwen3.5-debug and glm-5-debug")
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--transformer-impl", default="local", choices=["local", "transformer_engine"])
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args(argv)


def smoke(model_name: str, args) -> None:
    hf = resolve_hf_config(model_name)
    options = ModelOptions(transformer_impl=args.transformer_impl,
                           params_dtype=torch.bfloat16 if args.bf16 else torch.float32)
    model = build_model(hf, options)
    n_params = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, hf["vocab_size"], (args.micro_batch_size, args.seq_length + 1),
                           device=device())
    position_ids = torch.arange(args.seq_length, device=device()).expand(args.micro_batch_size, -1)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    loss_BS = model(tokens[:, :-1], position_ids, attention_mask=None, labels=tokens[:, 1:])
    loss = loss_BS.float().mean()
    loss.backward()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    grad_norm = torch.sqrt(sum(p.grad.float().pow(2).sum() for p in model.parameters() if p.grad is not None))
    peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if torch.cuda.is_available() else ""
    if torch.distributed.get_rank() == 0:
        print(f"{model_name}: {n_params / 1e6:.2f}M params/rank, {args.seq_length} tokens, "
              f"loss {loss.item():.4f}, grad norm {grad_norm.item():.4f}, "
              f"fwd+bwd {seconds:.2f} s{peak}", flush=True)
    if not torch.isfinite(loss) or not torch.isfinite(grad_norm):
        raise SystemExit(f"{model_name}: non-finite loss or gradient")


def main(argv=None) -> None:
    args = parse_args(argv)
    init_distributed(ParallelSizes(tensor=args.tensor_model_parallel_size), seed=args.seed)
    try:
        for name in args.model or ["qwen3.5-debug", "glm-5-debug"]:
            smoke(name, args)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        raise SystemExit(f"error: {err}")
