"""ptrain against PyTorch from the JSON lines of benchmarks/gpu_bench{,.py}.

    python3 tools/gpu/compare.py gpu_bench.jsonl

Prints one table per benchmark with both medians and the ratio ptrain / PyTorch
time (below 1: ptrain is faster), the way docs/benchmarks.md quotes them. Needs
only the standard library, so the file can be read on any machine.
"""
import json
import sys


def load(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line cut short by a timeout
    return rows


def by_impl(rows, bench, key):
    out = {}
    for r in rows:
        if r.get("bench") == bench:
            out.setdefault(r["impl"], {})[key(r)] = r
    return out.get("ptrain", {}), out.get("pytorch", {})


def ratio(a, b):
    return f"{a / b:6.2f}" if a and b else "     -"


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    rows = load(sys.argv[1])
    gpus = sorted({r["gpu"] for r in rows if "gpu" in r})
    print(f"GPU: {', '.join(gpus) or 'unknown'}")

    pt, th = by_impl(rows, "gpu_gemm", lambda r: (r["layer"], r["op"], r["precision"]))
    if pt or th:
        print("\nGEMM (TFLOP/s; ratio = ptrain time / PyTorch time)")
        print(f"{'layer':10} {'op':10} {'prec':5} {'M':>6} {'N':>6} {'K':>6} {'ptrain':>8} {'PyTorch':>8} {'ratio':>6}")
        # Layer by layer as measured, grouped by precision: FP32, TF32, then bf16.
        order = {"fp32": 0, "tf32": 1, "bf16": 2}
        for k in sorted(dict.fromkeys([*pt, *th]), key=lambda k: order.get(k[2], len(order))):
            a, b = pt.get(k, {}), th.get(k, {})
            r = a or b
            print(f"{k[0]:10} {k[1]:10} {k[2]:5} {r['m']:6} {r['n']:6} {r['k']:6} {a.get('tflops', 0):8.1f} "
                  f"{b.get('tflops', 0):8.1f} {ratio(a.get('median_ms'), b.get('median_ms'))}")

    pt, th = by_impl(rows, "gpu_bandwidth", lambda r: r["op"])
    if pt or th:
        print("\nMemory-bound kernels (GB/s on the minimum bytes; fraction of each side's copy bandwidth)")
        print(f"{'op':22} {'ptrain':>8} {'frac':>5} {'PyTorch':>8} {'frac':>5} {'ratio':>6}")
        for k in dict.fromkeys([*pt, *th]):
            a, b = pt.get(k, {}), th.get(k, {})
            print(f"{k:22} {a.get('GBps', 0):8.1f} {a.get('frac_of_copy', 0):5.2f} {b.get('GBps', 0):8.1f} "
                  f"{b.get('frac_of_copy', 0):5.2f} {ratio(a.get('median_ms'), b.get('median_ms'))}")

    fused = [r for r in rows if r.get("bench") == "gpu_epilogue"]
    if fused:
        print("\nbf16 backward with cuBLASLt epilogues against the same work apart (ratio = fused / apart)")
        print(f"{'layer':10} {'op':16} {'M':>6} {'N':>6} {'K':>6} {'fused_ms':>9} {'apart_ms':>9} {'ratio':>6}")
        for r in fused:
            f = r["fused_median_ms"] if r["fused"] else 0
            print(f"{r['layer']:10} {r['op']:16} {r['m']:6} {r['n']:6} {r['k']:6} {f:9.3f} "
                  f"{r['apart_median_ms']:9.3f} {ratio(f, r['apart_median_ms'])}")

    moe = [r for r in rows if r.get("bench") == "gpu_moe_gemm"]
    if moe:
        print("\nMoE experts' GEMMs, bf16: one grouped cuBLAS call against one GEMM per expert "
              "(ptrain only; ratio = grouped / per expert)")
        print(f"{'layer':12} {'op':10} {'grouped_ms':>10} {'TFLOP/s':>8} {'loop_ms':>9} {'TFLOP/s':>8} {'ratio':>6}")
        for r in moe:
            print(f"{r['layer']:12} {r['op']:10} {r['grouped_median_ms']:10.3f} {r['grouped_tflops']:8.1f} "
                  f"{r['loop_median_ms']:9.3f} {r['loop_tflops']:8.1f} "
                  f"{ratio(r['grouped_median_ms'], r['loop_median_ms'])}")

    steps = [r for r in rows if r.get("bench") in ("gpu_gpt_step", "gpu_gpt_step_graph")]
    if steps:
        def family(r):  # bf16 lines compare with ptrain's bf16 step at the same batch, the others with fp32/tf32
            return ("bf16" if r["precision"].startswith("bf16") else "fp32", r.get("batch"))

        refs = {}
        for r in steps:
            if r["impl"] == "ptrain":
                refs.setdefault(family(r), r)
        print("\nGPT training step (ratio = ptrain step of the same precision family / this step)")
        print(f"{'impl':8} {'attention':12} {'precision':22} {'batch':>5} {'step_ms':>8} {'tokens/s':>9} {'TFLOP/s':>8} "
              f"{'MFU':>6} {'GiB':>6} {'ratio':>6}")
        for r in steps:
            if r.get("gemm_epilogues") is False:
                r["precision"] += ",apart"  # --no-epilogues: bias and GELU as kernels of their own
            if r["bench"] == "gpu_gpt_step_graph":
                r["precision"] += ",graph"  # captured once, replayed each step
            if r.get("compile", "eager") != "eager":
                r["precision"] += ",compile"  # torch.compile: PyTorch's best recipe
            print(f"{r['impl']:8} {r['attention']:12} {r['precision']:22} {r.get('batch', 0):5} {r['step_ms_median']:8.1f} "
                  f"{r['tokens_per_s']:9.0f} {r['tflops']:8.1f} {r['mfu']:6.3f} {r.get('peak_mem_GiB', 0):6.1f} "
                  f"{ratio(refs.get(family(r), {}).get('step_ms_median'), r['step_ms_median'])}")

    llama = [r for r in rows if r.get("bench") == "gpu_llama_step"]
    if llama:
        ref = next((r for r in llama if r["impl"] == "ptrain"), {})
        print("\nLlama-shaped training step, bf16 (ratio = ptrain step / this step)")
        print(f"{'impl':8} {'compile':8} {'batch':>5} {'seq':>5} {'step_ms':>8} {'tokens/s':>9} {'TFLOP/s':>8} "
              f"{'MFU':>6} {'GiB':>6} {'ratio':>6}")
        for r in llama:
            print(f"{r['impl']:8} {'eager' if r['compile'] == 'eager' else 'compile':8} {r['batch']:5} {r['seq']:5} "
                  f"{r['step_ms_median']:8.1f} {r['tokens_per_s']:9.0f} {r['tflops']:8.1f} {r['mfu']:6.3f} "
                  f"{r.get('peak_mem_GiB', 0):6.1f} {ratio(ref.get('step_ms_median'), r['step_ms_median'])}")

    att = [r for r in rows if r.get("bench") == "gpu_attention"]
    if att:
        # The same shape on every backend; the ratio of TFLOP/s is the ratio of times.
        print("\nAttention, bf16 (TFLOP/s, causal on the causal half; flash_tc: the tensor-core kernels; "
              "ratio = ptrain's faster kernel's time over the faster PyTorch backend's)")
        print(f"{'pass':8} {'mask':6} {'S':>5} {'D':>4} {'ptrain':>8} {'flash_tc':>8} {'flash':>8} {'cudnn':>8} "
              f"{'ratio':>6}")
        cases = {}
        for r in att:
            cases.setdefault((r["pass"], r.get("causal", True), r["head_dim"], r["seq"]), {})[r["backend"]] = r
        for (pass_, causal, d, seq), c in sorted(cases.items(),
                                                 key=lambda kv: (kv[0][0] != "fwd", not kv[0][1], kv[0][2], kv[0][3])):
            tf = {b: c.get(b, {}).get("tflops", 0) for b in ("ptrain_flash", "ptrain_flash_tc", "sdpa_flash",
                                                           "sdpa_cudnn")}
            mine, theirs = max(tf["ptrain_flash"], tf["ptrain_flash_tc"]), max(tf["sdpa_flash"], tf["sdpa_cudnn"])
            print(f"{pass_:8} {'causal' if causal else 'full':6} {seq:5} {d:4} {tf['ptrain_flash']:8.1f} "
                  f"{tf['ptrain_flash_tc']:8.1f} {tf['sdpa_flash']:8.1f} {tf['sdpa_cudnn']:8.1f} "
                  f"{ratio(1 / mine if mine else None, 1 / theirs if theirs else None)}")

    # Sections that failed (gpu_bench{,.py} print one such line each and carry on).
    errors = [r for r in rows if r.get("bench") == "gpu_error"]
    if errors:
        print("\nFailed sections")
        for r in errors:
            msg = " ".join(str(r.get("error", "")).split())  # one line, however the message was wrapped
            print(f"{r.get('impl', '?'):8} {r.get('section', '?'):18} {msg[:300]}")


if __name__ == "__main__":
    main()
