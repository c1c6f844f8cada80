"""Tokens/s of a small randomly initialised Llama-style model in transformers, with
``attn_implementation="flashtune"`` against ``"sdpa"`` (torch's own choice of backend, and
forced to its flash and cuDNN backends), same weights, same run.

    python benchmarks/bench_transformers.py [--out benchmarks/results/transformers.json]

Prefill: one forward over ``batch x prompt`` tokens (tokens/s = batch x prompt / time).
Decode: ``generate`` of ``new`` tokens after the prompt with the KV cache, greedy; decode
tokens/s = batch x new / (generate time - prefill time). Before timing, the flashtune
model's logits are checked against the sdpa model's and greedy tokens compared.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

import flashtune.integrations.transformers  # noqa: E402,F401  (registers "flashtune")

CONTENDERS = {
    "flashtune": ("flashtune", None),
    "sdpa": ("sdpa", None),
    "sdpa_flash": ("sdpa", SDPBackend.FLASH_ATTENTION),
    "sdpa_cudnn": ("sdpa", SDPBackend.CUDNN_ATTENTION),
}


def model_config(args) -> LlamaConfig:
    return LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, max_position_embeddings=8192,
                       pad_token_id=0, eos_token_id=None, bos_token_id=None)


def timed(fn, reps: int) -> float:
    """Median seconds of ``reps`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/transformers.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    base = AutoModelForCausalLM.from_config(model_config(args), dtype=dtype,
                                            attn_implementation="sdpa").cuda().eval()
    models = {}
    for name, (impl, _) in CONTENDERS.items():
        m = AutoModelForCausalLM.from_config(copy.deepcopy(model_config(args)), dtype=dtype,
                                             attn_implementation=impl).cuda().eval()
        m.load_state_dict(base.state_dict())
        models[name] = m
    del base
    ids = torch.randint(1, 32000, (args.batch, args.prompt), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))

    def ctx(name):
        backend = CONTENDERS[name][1]
        return sdpa_kernel(backend) if backend is not None else nullcontext()

    with torch.no_grad():
        ours = models["flashtune"](ids[:, :512]).logits.float()
        ref = models["sdpa"](ids[:, :512]).logits.float()
    rel = ((ours - ref).norm() / ref.norm()).item()
    gen = {n: models[n].generate(ids[:2, :256], max_new_tokens=16, do_sample=False)
           for n in ("flashtune", "sdpa")}
    same_tokens = gen["flashtune"].tolist() == gen["sdpa"].tolist()
    print(f"check: logits rel err {rel:.2e}, greedy tokens equal: {same_tokens}")
    assert rel < 2e-2, rel

    rows = {}
    for name, model in models.items():
        with ctx(name), torch.no_grad():
            prefill = timed(lambda m=model: m(ids), args.reps)
            generate = timed(lambda m=model: m.generate(ids, max_new_tokens=args.new,
                                                        min_new_tokens=args.new,
                                                        do_sample=False), args.reps)
        decode = max(generate - prefill, 1e-9)
        rows[name] = {"prefill_s": prefill, "generate_s": generate,
                      "prefill_tok_s": args.batch * args.prompt / prefill,
                      "decode_tok_s": args.batch * args.new / decode}
    for name in rows:
        for other in ("sdpa", "sdpa_flash", "sdpa_cudnn"):
            rows[name][f"prefill_vs_{other}"] = rows[name]["prefill_tok_s"] / rows[other]["prefill_tok_s"]
            rows[name][f"decode_vs_{other}"] = rows[name]["decode_tok_s"] / rows[other]["decode_tok_s"]
    result = {"benchmark": "transformers tiny Llama tokens/s", "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "transformers": __import__("transformers").__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args),
              "check": {"logits_rel_err": rel, "greedy_tokens_equal": same_tokens},
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"model: hidden {args.hidden}, {args.layers} layers, {args.heads}:{args.kv_heads} heads "
          f"(D {args.hidden // args.heads}), bf16, batch {args.batch}, prompt {args.prompt}, "
          f"{args.new} new tokens")
    print("| attention | prefill tok/s | decode tok/s | prefill vs sdpa | decode vs sdpa |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['prefill_tok_s']:,.0f} | {r['decode_tok_s']:,.0f} | "
              f"{r['prefill_vs_sdpa']:.2f} | {r['decode_vs_sdpa']:.2f} |")


if __name__ == "__main__":
    main()
