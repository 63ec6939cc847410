"""The tables of kernels_micro.py: <out>/kernels.md from its <out>/kernels.jsonl and <out>/e2e.jsonl, newest row
per (kernel, implementation), each target marked met or missed.

(kernels_report.py is another report: the engine's end-to-end kernel A/B from the kernels sweep.)
"""
import json
import os


def read_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_markdown(out):
    """Tables from the jsonl files, newest row per (kernel, impl), targets marked; writes kernels.md
    and returns its text."""
    rows, variants = {}, []
    for r in read_jsonl(os.path.join(out, "kernels.jsonl")):
        if r["kind"] == "variant":
            variants.append(r)
        else:
            rows.setdefault(r["kernel"], {})[r["impl"]] = r
    lines = ["# stronghold_ops kernel benchmark (bf16, forward + backward)", ""]
    metas = {(r["device"], r["commit"], r["date"][:10], r["torch"]) for k in rows.values() for r in k.values()}
    for device, commit, date, torch_version in sorted(metas):
        lines.append(f"- device: {device}; commit {commit}; {date}; torch {torch_version}")
    lines += ["", "Median ms (triton.testing.do_bench) / peak MB beyond the inputs. Targets: >= 1.0x eager "
              "and >= 0.9x torch.compile for every kernel; linear-CE at vocab 128256: peak <= 1/4 of eager "
              "and time <= 1.1x eager.", "",
              "| kernel | shape | stronghold_ops | eager | torch.compile | liger | x eager | x compile | "
              "rel err (ours) | targets |", "|---|---|---|---|---|---|---|---|---|---|"]

    def cell(r):
        if r is None:
            return "n/a"
        return f"error: {r['error'][:60]}" if "error" in r else f"{r['ms']:.3f} / {r['peak_mb']:.0f}"

    for kernel, impls in rows.items():
        ours, eager, comp = impls.get("stronghold_ops"), impls.get("eager"), impls.get("torch_compile")
        ok = all(r is not None and "ms" in r for r in (ours, eager))
        vs_eager = eager["ms"] / ours["ms"] if ok else float("nan")
        vs_comp = comp["ms"] / ours["ms"] if ok and comp and "ms" in comp else float("nan")
        verdict = [f"eager {'met' if vs_eager >= 1.0 else 'MISSED'}",
                   f"compile {'met' if vs_comp >= 0.9 else 'MISSED'}"]
        if kernel == "linear_ce_128256" and ok:
            mem = ours["peak_mb"] / eager["peak_mb"]
            verdict += [f"mem {mem:.2f}x {'met' if mem <= 0.25 else 'MISSED'}",
                        f"time {1 / vs_eager:.2f}x {'met' if 1 / vs_eager <= 1.1 else 'MISSED'}"]
        err = f"{ours['max_rel_err_vs_fp32']:.1e}" if ours and "max_rel_err_vs_fp32" in ours else "n/a"
        lines.append(f"| {kernel} | {ours['shape'] if ours else ''} | {cell(ours)} | {cell(eager)} | {cell(comp)} | "
                     f"{cell(impls.get('liger'))} | {vs_eager:.2f} | {vs_comp:.2f} | {err} | {', '.join(verdict)} |")
    if variants:
        lines += ["", "Norm launch variants (stronghold_ops only; \"default\" is timed first and last, its spread is the noise):", "",
                  "ms: do_bench as above; graph ms: the device work alone (CUDA-graph replays); host ms: "
                  "Python and launch time per call.", "",
                  "| kernel | variant | ms | graph ms | host ms | peak MB | rel err |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['kernel']} | {r['impl']} | {r['ms']:.3f} | {r.get('graph_ms', float('nan')):.3f} | "
                  f"{r.get('host_ms', float('nan')):.3f} | {r['peak_mb']:.0f} | "
                  + (f"{r['max_rel_err_vs_fp32']:.1e} |" if "max_rel_err_vs_fp32" in r else "- |") for r in variants]
    e2e = {r["mode"]: r for r in read_jsonl(os.path.join(out, "e2e.jsonl"))}
    if {"hf", "stronghold_ops"} <= e2e.keys():
        hf, so = e2e["hf"], e2e["stronghold_ops"]
        lines += ["", "# End-to-end training step (Llama-style, bf16, forward + backward + AdamW)", "",
                  f"{hf['params'] / 1e9:.2f} B parameters, config {json.dumps(hf['config'])}; "
                  f"loss before training: HF {hf['loss_hf']:.5f}, patched {hf['loss_stronghold_ops']:.5f}", "",
                  "| mode | step ms (median of 6) | peak GB |", "|---|---|---|",
                  f"| HF | {hf['step_ms_median']:.1f} | {hf['peak_gb']:.2f} |",
                  f"| stronghold_ops.apply | {so['step_ms_median']:.1f} | {so['peak_gb']:.2f} |", "",
                  f"Speedup {hf['step_ms_median'] / so['step_ms_median']:.3f}x; peak memory "
                  f"{so['peak_gb'] / hf['peak_gb']:.3f}x of HF."]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "kernels.md"), "w") as f:
        f.write(text)
    return text
