"""A decode step with the new token's K/V appended and rotary applied (issue 31, item 4):
flashtune's fused call vs its attention alone on the same cache vs the unfused torch
sequence (cache write, rotary, attention), with torch SDPA's flash and cuDNN backends for
reference.

    python benchmarks/bench_kvcache_append.py [--batches 1,4,16,32,64]
        [--seqlens 4096,8192,16384,32768] [--page-size 64 | --page-size 0]
        [--timing both|eager|graph] [--variant-batches 1,4]
        [--out benchmarks/results/kvcache_append.json]

Grid: Nq = 1 and one new key per sequence, Hq 32, Hkv 8, D 128, bf16, GPT-NeoX rotary on
every dim (Llama); every sequence holds ``Nk - 1`` keys before the step, so it attends to
``Nk`` after it (the cache's capacity). Shapes whose K+V exceed --max-kv-gb are skipped.

Per shape, on a contiguous cache ``(B, Hkv, Nk, D)``, then (unless --page-size 0) on a paged
one of the same size (shuffled pages; one cache held at a time):

* ``fused``: ``flashtune.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=,
  v=, rotary_cos=, rotary_sin=, rotary_interleaved=False)``: the append, the rotary of q and
  k and the attention in one launch (plus split-KV's combine), the public call as a decoding
  loop makes it (its launch plan after the first call).
* ``attention``: ``flashtune.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens + 1)``
  on the same cache: the attention alone over the same keys. Issue 31's target: ``fused`` at
  most 1.1x this.
* ``append_only``: the fused call without rotary (``k``/``v`` only): what the rotary adds.
* ``unfused_flashtune``: the torch sequence a model runs without the fused call (rotary of q
  and k in torch, in bf16 as HF's ``apply_rotary_pos_emb``; the cache write by an indexed
  store; ``cache_seqlens + 1``) then flashtune's attention.
* ``unfused_sdpa_flash`` / ``unfused_sdpa_cudnn`` (contiguous only): the same torch steps, then
  SDPA (``enable_gqa=True``) over the whole cache.
* ``sdpa_flash`` / ``sdpa_cudnn`` (contiguous only): SDPA's attention alone, for reference
  as the other decode scripts report it.
* ``fused_launcher_own_rows`` / ``fused_launcher_last_split`` (``--variant-batches``, split
  configs only): the fused call through the launcher, the new keys walked by programs in
  grid rows of their own (as served) or by the last split (the fallback past the grid's
  limit).

Timings: ``eager`` is :func:`flashtune.autotune.timing.bench` (cold L2, calls as launched,
host cost hidden as bench does for short kernels), ``graph`` is
:func:`~flashtune.autotune.timing.bench_graph` (CUDA-graph replays: GPU time only, warm L2).
Every implementation's output is checked against the fused call's reference (fp32, batch 0)
before it is timed, and the fused call's cache slot against the torch write; every
sequence's appended key and value are compared bit for bit with the reference rotation.
Effective bandwidth as bench_decode.py's: ``2 B Hkv Nk D elem_size`` bytes, in TB/s. Prints
a markdown table last; writes the full figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,16,32,64")
    ap.add_argument("--seqlens", default="4096,8192,16384,32768")
    ap.add_argument("--heads-q", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--page-size", type=int, default=64, help="0: contiguous caches only")
    ap.add_argument("--max-kv-gb", type=float, default=40.0,
                    help="skip shapes whose K+V take more than this many GB")
    ap.add_argument("--timing", default="both", choices=["both", "eager", "graph"])
    ap.add_argument("--out", default="benchmarks/results/kvcache_append.json")
    ap.add_argument("--variant-batches", default="",
                    help="batches (e.g. 1,4) where split configs also time the fused call "
                         "through the launcher with the new keys in their own grid rows "
                         "(as served) and walked by the last split instead")
    return ap.parse_args(argv)


def kv_bytes(b, hkv, nk, d, elem=2):
    return 2 * b * hkv * nk * d * elem


def neox_rotary(x, cos, sin, pos):
    """GPT-NeoX rotary of ``x`` (B, H, N, D) at positions ``pos`` (B, N), in x's dtype (as
    transformers' ``apply_rotary_pos_emb``)."""
    import torch

    rd = 2 * cos.shape[1]
    c, s = cos[pos][:, None], sin[pos][:, None]
    x1, x2 = x[..., :rd // 2], x[..., rd // 2:rd]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, x[..., rd:]), dim=-1)


def main() -> None:
    args = parse_args()
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashtune
    from flashtune.autotune.timing import bench, bench_graph
    from flashtune.core.device import cuda_device
    from flashtune.core.problem import AttentionProblem
    from flashtune.kernel_templates import get_template
    from flashtune.kernel_templates.attn_decode import launcher
    from flashtune.kernel_templates.attn_decode.reference import (
        attn_decode_kvcache_reference,
        attn_decode_reference,
        rotary_reference,
    )
    from flashtune.runtime import kvcache
    from flashtune.runtime.kvcache import attention_with_kvcache

    backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
                "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    spec = get_template("attn_decode")
    dev = cuda_device()
    hq, hkv, d, ps = args.heads_q, args.heads_kv, args.head_dim, args.page_size

    def timed(fn):
        out = {}
        torch.cuda.synchronize()
        if args.timing in ("both", "eager"):
            t = bench(fn)
            out.update(median_ms=t.median_ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms)
        if args.timing in ("both", "graph"):
            out["graph_ms"] = float(bench_graph(fn))
        return out

    def check(name, out, ref):
        rel = ((out[:1].float() - ref).norm() / ref.norm()).item()
        limit = 2e-2 if dtype == torch.bfloat16 else 5e-3
        if not rel < limit:
            raise SystemExit(f"{name}: relative error {rel:.2e} >= {limit}; refusing to time it")
        return rel

    def run_impl(row, name, fn, ref, call=None):
        """Check ``fn`` against ``ref`` (batch 0; a callable: computed after fn ran once),
        then time it."""
        try:
            out = fn()
            rel = check(name, out, ref() if callable(ref) else ref)
            row[name] = {**timed(fn), "relerr": rel}
            for key, tb_key in (("median_ms", "tbps"), ("graph_ms", "graph_tbps")):
                if key in row[name]:
                    row[name][tb_key] = row["bytes"] / (row[name][key] * 1e-3) / 1e12
            if call:
                row[name]["call"] = call
        except RuntimeError as exc:  # a backend that does not serve the shape, or OOM
            row[name] = {"error": str(exc).splitlines()[0][:200]}

    def phase(row, b, nk, q, knew, vnew, cos, sin, lens, paged):
        """Every implementation on one cache (contiguous, or paged with shuffled pages)."""
        suffix = "_paged" if paged else ""
        table = None
        if paged:
            num_pages = b * (nk // ps)
            table = torch.randperm(num_pages, device="cuda").to(torch.int32).view(b, -1)
            kc = torch.randn(num_pages, hkv, ps, d, device="cuda", dtype=dtype)
        else:
            kc = torch.randn(b, hkv, nk, d, device="cuda", dtype=dtype)
        vc = torch.randn_like(kc)
        lens_after = lens + 1
        ref, _, k_ref, _ = attn_decode_kvcache_reference(
            q[:1], kc, vc, lens[:1], k=knew[:1], v=vnew[:1], rotary_cos=cos, rotary_sin=sin,
            rotary_interleaved=False, block_table=None if table is None else table[:1],
            causal=True, dtype=torch.float32)
        batch = torch.arange(b, device="cuda")

        def fused():
            return attention_with_kvcache(q, kc, vc, lens, k=knew, v=vnew, rotary_cos=cos,
                                          rotary_sin=sin, rotary_interleaved=False,
                                          block_table=table, causal=True)

        def append_only():
            return attention_with_kvcache(q, kc, vc, lens, k=knew, v=vnew, block_table=table,
                                          causal=True)

        def attention():
            return attention_with_kvcache(q, kc, vc, lens_after, block_table=table,
                                          causal=True)

        def torch_steps():
            """rotary of q and k at position lens[b], the cache write, the new lengths."""
            pos = lens.long()[:, None]
            q_rot, k_rot = neox_rotary(q, cos, sin, pos), neox_rotary(knew, cos, sin, pos)
            if table is None:
                kc[batch, :, lens.long()] = k_rot[:, :, 0]
                vc[batch, :, lens.long()] = vnew[:, :, 0]
            else:
                page = table[batch, lens.long() // ps].long()
                slot = lens.long() % ps
                kc[page, :, slot] = k_rot[:, :, 0]
                vc[page, :, slot] = vnew[:, :, 0]
            return q_rot, lens + 1

        def unfused_flashtune():
            q_rot, new_lens = torch_steps()
            return attention_with_kvcache(q_rot, kc, vc, new_lens, block_table=table,
                                          causal=True)

        if b in variant_batches:
            problem = AttentionProblem(b, hq, hkv, 1, nk, d, True, args.dtype, -1, -1, 0.0,
                                       False)
            cfg = kvcache.DISPATCH.peek(problem, kvcache._device("cuda", None)).config
            row[f"config{suffix}"] = dict(cfg)
            if cfg["NUM_SPLITS"] > 1:
                for name, rows_limit in (("fused_launcher_own_rows", launcher.MAX_GRID_Y),
                                         ("fused_launcher_last_split", 0)):
                    def variant(rows_limit=rows_limit):
                        saved, launcher.MAX_GRID_Y = launcher.MAX_GRID_Y, rows_limit
                        try:
                            return launcher.attn_decode_kvcache(
                                q, kc, vc, lens, cfg, k=knew, v=vnew, rotary_cos=cos,
                                rotary_sin=sin, rotary_interleaved=False, block_table=table,
                                causal=True)
                        finally:
                            launcher.MAX_GRID_Y = saved

                    run_impl(row, f"{name}{suffix}", variant, ref,
                             "launcher, new keys in their own rows" if rows_limit
                             else "launcher, new keys walked by the last split")

        # the fused call's cache slot against the torch write (both rotate at lens[0])
        fused()
        slot = (lambda t: t[0, :, int(lens[0])]) if table is None else (
            lambda t: t[int(table[0, int(lens[0]) // ps]), :, int(lens[0]) % ps])
        ours = slot(kc).float().clone()
        slot_err = (ours - slot(k_ref).float()).abs().max().item()
        # every sequence's new slot (B, Hkv, D) against the reference rotation (fp32 math
        # rounded to the dtype, as the kernel does): bit-exact expected
        pos = lens.long()
        if table is None:
            written = kc[batch, :, pos]
        else:
            written = kc[table[batch, pos // ps].long(), :, pos % ps]
        want = rotary_reference(knew, cos, sin, pos[:, None], interleaved=False)[:, :, 0]
        row[f"k_slots_bit_exact{suffix}"] = bool(torch.equal(written, want))
        row[f"v_slots_bit_exact{suffix}"] = bool(torch.equal(
            vc[batch, :, pos] if table is None
            else vc[table[batch, pos // ps].long(), :, pos % ps], vnew[:, :, 0]))
        torch_steps()
        row[f"k_slot_vs_torch_write{suffix}"] = (ours - slot(kc).float()).abs().max().item()
        row[f"k_slot_vs_reference{suffix}"] = slot_err
        run_impl(row, f"fused{suffix}", fused, ref, "k, v, rotary_cos/sin (NeoX), causal")
        # the attention alone: q not rotated, over the cache the step left
        run_impl(row, f"attention{suffix}", attention,
                 lambda: attn_decode_reference(
                     q[:1], kc, vc, cache_seqlens=lens_after[:1],
                     block_table=None if table is None else table[:1],
                     dtype=torch.float32)[0],
                 "cache_seqlens + 1, no options")
        # the append alone (no rotary): what the rotary of q and k adds to the fused call
        run_impl(row, f"append_only{suffix}", append_only,
                 lambda: attn_decode_kvcache_reference(
                     q[:1], kc, vc, lens[:1], k=knew[:1], v=vnew[:1],
                     block_table=None if table is None else table[:1], causal=True,
                     dtype=torch.float32)[0],
                 "k, v, no rotary")
        run_impl(row, f"unfused_flashtune{suffix}", unfused_flashtune, ref,
                 "torch rotary (bf16) + indexed cache write + lens + 1, then flashtune")
        if not paged:
            for name, backend in backends.items():
                def sdpa(backend=backend):
                    with sdpa_kernel(backend):
                        return torch.nn.functional.scaled_dot_product_attention(
                            q, kc, vc, enable_gqa=True)

                def unfused_sdpa(backend=backend):
                    q_rot, _ = torch_steps()
                    with sdpa_kernel(backend):
                        return torch.nn.functional.scaled_dot_product_attention(
                            q_rot, kc, vc, enable_gqa=True)

                # SDPA over the whole cache: every sequence holds Nk keys after the step;
                # its reference is the attention of the rotated q (the fused call's)
                run_impl(row, f"unfused_{name}", unfused_sdpa, ref, "enable_gqa=True")
                run_impl(row, name, sdpa,
                         lambda: attn_decode_reference(q[:1], kc[:1], vc[:1],
                                                       dtype=torch.float32)[0],
                         "enable_gqa=True, q not rotated")
        del kc, vc

    variant_batches = {int(x) for x in args.variant_batches.split(",") if x}
    rows = []
    t0 = time.time()
    for b in (int(x) for x in args.batches.split(",")):
        for nk in (int(x) for x in args.seqlens.split(",")):
            nbytes = kv_bytes(b, hkv, nk, d, torch.finfo(dtype).bits // 8)
            if nbytes > args.max_kv_gb * 1e9:
                print(f"skip B={b} Nk={nk}: K+V {nbytes / 1e9:.1f} GB > {args.max_kv_gb} GB",
                      file=sys.stderr)
                continue
            torch.manual_seed(0)
            q = torch.randn(b, hq, 1, d, device="cuda", dtype=dtype)
            knew = torch.randn(b, hkv, 1, d, device="cuda", dtype=dtype)
            vnew = torch.randn_like(knew)
            angle = torch.rand(nk, d // 2, device="cuda") * 2 * math.pi
            cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
            lens = torch.full((b,), nk - 1, dtype=torch.int32, device="cuda")
            row = {"batch": b, "seqlen_k": nk, "bytes": nbytes}
            for paged in ([False, True] if ps else [False]):
                phase(row, b, nk, q, knew, vnew, cos, sin, lens, paged)
                torch.cuda.empty_cache()
            for key in ("median_ms", "graph_ms"):
                for sfx in ("", "_paged"):
                    base = row.get(f"attention{sfx}", {}).get(key)
                    for name in ("fused", "append_only", "unfused_flashtune",
                                 "unfused_sdpa_flash", "unfused_sdpa_cudnn",
                                 "fused_launcher_own_rows", "fused_launcher_last_split"):
                        t = row.get(f"{name}{sfx}", {}).get(key)
                        if base and t:
                            row.setdefault("vs_attention", {})[f"{name}{sfx}/{key}"] = t / base
            rows.append(row)
            print(f"B={b} Nk={nk}: " + json.dumps(row.get("vs_attention", {})),
                  file=sys.stderr, flush=True)
    result = {
        "benchmark": "decode step with append + rotary (Nq=1, one new key)",
        "dtype": args.dtype, "page_size": ps, "heads_q": hq, "heads_kv": hkv,
        "head_dim": d, "rotary": "GPT-NeoX, rotary_dim = head_dim", "timing": args.timing,
        "bytes_formula": "2 * B * Hkv * Nk * D * elem_size (ANCHORS.md)",
        "device": dev.to_dict(), "torch": torch.__version__, "triton": triton.__version__,
        "flashtune": flashtune.__version__, "source_hash": spec.source_hash,
        "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "wall_s": time.time() - t0, "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print_table(rows, "graph_ms" if args.timing == "graph" else "median_ms")
    if args.timing == "both":
        print()
        print_table(rows, "graph_ms")


def print_table(rows, key):
    cols = ["fused", "attention", "append_only", "unfused_flashtune", "unfused_sdpa_flash",
            "unfused_sdpa_cudnn", "sdpa_flash", "sdpa_cudnn", "fused_paged",
            "attention_paged", "append_only_paged", "unfused_flashtune_paged"]
    cols = [c for c in cols if any(key in r.get(c, {}) for r in rows)]
    print(f"{key} in us; ratios to flashtune's attention alone on the same cache")
    head = ("| B | Nk | " + " | ".join(cols) + " | fused/attn | unfused_ft/attn |"
            + (" paged fused/attn |" if "fused_paged" in cols else ""))
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    ratios = {"fused": [], "unfused_flashtune": [], "fused_paged": []}
    for r in rows:
        cells = [f"{r[c][key] * 1e3:.1f}" if key in r.get(c, {}) else "n/a" for c in cols]
        extra = []
        for name, base in (("fused", "attention"), ("unfused_flashtune", "attention"),
                           ("fused_paged", "attention_paged")):
            if name == "fused_paged" and "fused_paged" not in cols:
                continue
            a, bb = r.get(name, {}).get(key), r.get(base, {}).get(key)
            if a and bb:
                ratios[name].append(a / bb)
            extra.append(f"{a / bb:.3f}" if a and bb else "n/a")
        print(f"| {r['batch']} | {r['seqlen_k']} | " + " | ".join(cells + extra) + " |")

    def gm(xs):
        return 2 ** (sum(math.log2(x) for x in xs) / len(xs)) if xs else float("nan")

    exact = [r.get(k) for r in rows for k in ("k_slots_bit_exact", "v_slots_bit_exact",
                                               "k_slots_bit_exact_paged",
                                               "v_slots_bit_exact_paged") if k in r]
    print(f"appended slots bit-exact with the reference rotation: {sum(exact)} of "
          f"{len(exact)}")
    print("geomean ratio to attention alone: " + ", ".join(
        f"{n} {gm(v):.3f} (max {max(v):.3f})" for n, v in ratios.items() if v))


if __name__ == "__main__":
    main()
