"""Train a small Hugging Face MoE causal LM (Qwen3-MoE, random init) with mok as its experts.

    PYTHONPATH=python python3 examples/train_hf.py                       # cuda if available, else cpu
    PYTHONPATH=python python3 examples/train_hf.py --device cpu --steps 50

`import mok.integrations.hf` registers "mok" with transformers' experts interface; the model is
then built with experts_implementation="mok", and every MoE layer's experts (forward and
backward) run through mok.experts on the model's own gate_up_proj / down_proj parameters.  The
corpus is synthetic and fixed: sequences that count up from a random token by a random stride.
Exits non-zero if the loss did not go down or an experts module fell back to transformers'
grouped_mm (mok.integrations.hf.MokFallbackWarning).
"""
import argparse
import sys
import warnings

import torch

import mok

try:
    from mok.integrations import hf
except ImportError as e:  # transformers is not installed
    sys.exit(str(e))
from transformers import AutoModelForCausalLM, Qwen3MoeConfig


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    # The defaults satisfy mok's CUDA shape rules (H and I multiples of 64, forward and backward),
    # so the same command runs on both devices.
    p.add_argument("--tokens", type=int, default=128, help="tokens per batch (batch = tokens / seq)")
    p.add_argument("--seq", type=int, default=32, help="sequence length")
    p.add_argument("--hidden", type=int, default=256, help="model width")
    p.add_argument("--intermediate", type=int, default=256, help="width of each expert")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
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


def make_corpus(args) -> torch.Tensor:
    """[batch, seq] token ids, every step's batch: each sequence counts from a random start by a
    random stride (mod vocab), so the next token follows from the last two."""
    gen = torch.Generator().manual_seed(args.seed)
    shape = (max(args.tokens // args.seq, 1), 1)
    start = torch.randint(0, args.vocab, shape, generator=gen)
    stride = torch.randint(1, 8, shape, generator=gen)
    return (start + stride * torch.arange(args.seq)) % args.vocab


def make_model(args, device: torch.device):
    config = Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        moe_intermediate_size=args.intermediate, num_experts=args.experts, num_experts_per_tok=args.topk,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=args.seq, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(args.seed)  # the initial weights
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, experts_implementation="mok").to(device)


def main():
    args = parse_args()
    device = pick_device(args.device)
    corpus = make_corpus(args).to(device)  # a fixed batch, every step
    model = make_model(args, device)
    num_moe = sum(1 for m in model.modules() if hasattr(m, "gate_up_proj"))
    print(f"mok {mok.__version__}: Qwen3-MoE, {args.layers} layers ({num_moe} MoE), {args.experts} experts top-"
          f"{args.topk}, hidden {args.hidden}, expert width {args.intermediate}, experts_implementation="
          f"{model.config._experts_implementation!r}, device {device}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", hf.MokFallbackWarning)
        for step in range(1, args.steps + 1):
            optimizer.zero_grad(set_to_none=True)
            loss = model(corpus, labels=corpus).loss  # next-token cross-entropy, in fp32
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            print(f"step {step:3d}  loss {losses[-1]:.6f}")
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, hf.MokFallbackWarning)]

    print(f"loss {losses[0]:.6f} -> {losses[-1]:.6f} ({100 * (1 - losses[-1] / losses[0]):.1f}% lower)")
    if fallbacks:
        sys.exit("FAIL: experts ran transformers' grouped_mm instead of mok:\n  " + "\n  ".join(fallbacks))
    if not losses[-1] < losses[0]:
        sys.exit("FAIL: the loss did not go down")
    print("OK: the loss went down")


if __name__ == "__main__":
    main()
