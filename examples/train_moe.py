"""Train a small mok.nn.MoE layer on a toy regression task.

The layer learns to imitate a fixed random "teacher" function of its inputs.  Everything is
seeded and mok's layer is bitwise deterministic; the router's fp32 matmul is PyTorch's, whose
CPU results can depend on buffer alignment, so two runs may rarely differ in the last digits.

    PYTHONPATH=python python3 examples/train_moe.py                  # cuda if available, else cpu
    PYTHONPATH=python python3 examples/train_moe.py --device cpu --steps 50

On the CPU, mok's reference backend runs forward and backward.  On a CUDA GPU the forward runs
on the GPU; where this version of mok has no GPU backward yet, the example says so, trains on
the CPU instead and checks every GPU forward against the CPU forward of the same weights.
Exits non-zero if the loss did not go down (or the GPU forward disagrees with the CPU's).
"""
import argparse
import copy
import sys
from typing import Optional

import torch

import mok


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    # The defaults satisfy the CUDA shape rules (H, I and I_s multiples of 64),
    # so the same command runs on both devices.
    p.add_argument("--tokens", type=int, default=256, help="T, tokens per batch")
    p.add_argument("--hidden", type=int, default=256, help="H, model width")
    p.add_argument("--intermediate", type=int, default=128, help="I, width of each routed expert")
    p.add_argument("--shared", type=int, default=128, help="I_s, width of the shared expert (0: none)")
    p.add_argument("--experts", type=int, default=8, help="E, routed experts")
    p.add_argument("--topk", type=int, default=2, help="k, experts per token")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def pick_device(choice: str) -> torch.device:
    gpu_ok = torch.cuda.is_available() and mok.has_cuda()
    if choice == "cuda" and not gpu_ok:
        sys.exit("--device cuda: " + ("libmok was built without its CUDA part" if torch.cuda.is_available()
                                      else "PyTorch sees no CUDA GPU"))
    if choice == "auto":
        choice = "cuda" if gpu_ok else "cpu"
    return torch.device(choice)


def make_task(args):
    """Fixed inputs x [T, H] and targets = teacher(x): a random two-layer tanh network."""
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.tokens, args.hidden, generator=gen)
    w1 = torch.randn(args.hidden, args.hidden, generator=gen) / args.hidden ** 0.5
    w2 = torch.randn(args.hidden, args.hidden, generator=gen) / args.hidden ** 0.5
    target = 0.2 * torch.tanh(x @ w1) @ w2
    # mok takes bf16 activations; the loss is computed in fp32.
    return x.to(torch.bfloat16), target


def gpu_backward_missing(model: torch.nn.Module, x: torch.Tensor) -> Optional[str]:
    """Runs one forward and backward through the layer: None when the backward ran, else the
    reason it is not available (the message of mok's NotImplementedError)."""
    y = model(x)  # forward errors (e.g. shapes the GPU does not take) are raised, not hidden
    try:
        y.float().square().mean().backward()
        return None
    except NotImplementedError as e:
        return str(e)
    finally:
        model.zero_grad(set_to_none=True)


def rel_frobenius(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


def main():
    args = parse_args()
    device = pick_device(args.device)
    torch.manual_seed(args.seed)  # the layer's initial weights
    x, target = make_task(args)

    # The layer: bf16 SwiGLU experts, an optional shared expert, and its own fp32 top-k router.
    model = mok.nn.MoE(args.hidden, args.intermediate, args.experts, args.topk, args.shared)
    print(f"mok {mok.__version__}: {model}")

    # Where to train.  gpu_check: a GPU copy of the layer whose forward is checked each step.
    train_device, gpu_check = device, None
    if device.type == "cuda":
        gpu_model = copy.deepcopy(model).to(device)
        missing = gpu_backward_missing(gpu_model, x.to(device))
        if missing is None:
            model = gpu_model
            print("device: cuda (forward and backward on the GPU)")
        else:
            train_device, gpu_check = torch.device("cpu"), gpu_model
            print(f"device: cuda for the forward only: the GPU backward is not built in this version of mok\n"
                  f"        ({missing});\n"
                  f"        training on the CPU, checking the GPU forward against the CPU forward each step")
    else:
        print("device: cpu (mok's reference backend)")
    x, target = x.to(train_device), target.to(train_device)

    # Any torch optimizer works: the layer's parameters are ordinary nn.Parameters.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    losses, gpu_errors = [], []
    for step in range(1, args.steps + 1):
        optimizer.zero_grad(set_to_none=True)
        # Route once, so that the GPU check below sees exactly the same expert choices.
        topk_ids, topk_weights = model.route(x)
        y = model(x, topk_ids, topk_weights)  # the router still trains: grads reach topk_weights
        loss = (y.float() - target).square().mean()
        loss.backward()
        line = f"step {step:3d}  loss {loss.item():.6f}"

        if gpu_check is not None:
            # The same weights and routing through the GPU forward (bf16 agreement: < 1e-2).
            with torch.no_grad():
                gpu_check.load_state_dict(model.state_dict())
                y_gpu = gpu_check(x.to(device), topk_ids.to(device), topk_weights.to(device))
            gpu_errors.append(rel_frobenius(y_gpu, y.detach()))
            line += f"  (GPU forward vs CPU: rel. Frobenius {gpu_errors[-1]:.2e})"

        optimizer.step()
        losses.append(loss.item())
        print(line)

    drop = 1.0 - losses[-1] / losses[0]
    print(f"loss {losses[0]:.6f} -> {losses[-1]:.6f} ({100 * drop:.1f}% lower)")
    if not losses[-1] < losses[0]:
        sys.exit("FAIL: the loss did not go down")
    print("OK: the loss went down")
    if gpu_errors:
        print(f"GPU forward vs CPU forward: worst rel. Frobenius error {max(gpu_errors):.2e} (tolerance 1e-2)")
        if not max(gpu_errors) < 1e-2:
            sys.exit("FAIL: the GPU forward disagrees with the CPU forward")


if __name__ == "__main__":
    main()
