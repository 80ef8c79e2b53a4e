"""One command for an accelerator: parity, update MFU, decode throughput and a GRPO step, beside the plan's prediction.

On whatever device JAX finds (one device), with random weights from configs written here (no download):

(a) logits parity with transformers on the same device, float32 and bfloat16, tiny random Qwen2;
(b) the actor update's tokens/s and MFU, Qwen2.5-0.5B and 1.5B shapes, packed 4096-token rows, bf16 compute over
    float32 weights and AdamW state, remat off and on;
(c) sampler decode tokens/s at 64 and 256 slots to 512 new tokens (bf16), against the HBM roofline (every weight
    and the KV cache read once per step) and against transformers ``generate`` on the same device in the same run;
(d) one GRPO step of the random 0.5B shape with its stage times;
(e) one MoE layer's routed experts (Qwen3-30B-A3B's shapes, 4096 tokens), forward and backward, with each grouped
    product (``ragged_dot`` and blocked): tokens/s, routed TFLOP/s, how far their outputs are apart;
(f) beside each, the plan's prediction: ``rlhf_jax.plan``'s roofline time of the very program that ran
    (``plan_prediction``; "n/a" with the reason when that package or the chip's figures are missing).

    python benchmarks/accelerator.py                 # writes benchmarks/results/accelerator_<device>.json
    python benchmarks/accelerator.py --smoke         # the same code, tiny sizes, on the CPU (CI)

Needs jax, flax, optax, numpy, transformers and torch only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
if "--smoke" in sys.argv:
    os.environ["JAX_PLATFORMS"] = "cpu"
# The actor and the reference compile the same programs: the persistent cache compiles them once (and a rerun
# starts from it). Each program's first call, compile or cache load included, is reported apart.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/rlhf_jax/jax-bench-cache"))

# Public config.json values of the Qwen2.5 base models (Hugging Face Hub, Qwen/Qwen2.5-0.5B and Qwen/Qwen2.5-1.5B).
QWEN25 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "rms_norm_eps": 1e-6,
          "rope_theta": 1000000.0, "tie_word_embeddings": True, "vocab_size": 151936, "use_sliding_window": False,
          "bos_token_id": 151643, "eos_token_id": 151643, "attention_dropout": 0.0, "initializer_range": 0.02}
MODELS = {
    "Qwen2.5-0.5B": {**QWEN25, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768},
    "Qwen2.5-1.5B": {**QWEN25, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 131072},
    # the smoke run's stand-in (and the parity model): Qwen2 layout, tiny
    "tiny-qwen2": {**QWEN25, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
                   "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
}


@dataclasses.dataclass(frozen=True)
class Sizes:
    update_models: tuple[str, ...]
    sequences: int  # per update: prompt_len + response_len tokens each, packed into rows of row_len
    prompt_len: int
    response_len: int
    row_len: int
    rows_per_micro: int
    decode_model: str
    slots: tuple[int, ...]
    decode_prompt_len: int
    new_tokens: int
    grpo_model: str
    grpo_prompts: int
    grpo_n: int
    grpo_prompt_len: int
    grpo_new_tokens: int
    parity_tokens: int
    repeats: int
    moe: tuple[int, int, int, int, int] = (4096, 128, 2048, 768, 8)  # tokens, experts, hidden, width, top-k




FULL = Sizes(update_models=("Qwen2.5-0.5B", "Qwen2.5-1.5B"), sequences=16, prompt_len=256, response_len=768,
             row_len=4096, rows_per_micro=1, decode_model="Qwen2.5-0.5B", slots=(64, 256), decode_prompt_len=128,
             new_tokens=512, grpo_model="Qwen2.5-0.5B", grpo_prompts=16, grpo_n=8, grpo_prompt_len=128,
             grpo_new_tokens=512, parity_tokens=64, repeats=2)
SMOKE = Sizes(update_models=("tiny-qwen2",), sequences=4, prompt_len=16, response_len=48, row_len=128,
              rows_per_micro=1, decode_model="tiny-qwen2", slots=(4, 8), decode_prompt_len=8, new_tokens=16,
              grpo_model="tiny-qwen2", grpo_prompts=2, grpo_n=2, grpo_prompt_len=8, grpo_new_tokens=8,
              parity_tokens=16, repeats=1, moe=(64, 8, 64, 32, 2))


# ----------------------------------------------------------------------------- (f) the plan's prediction
def plan_prediction(name: str, compiled, *, model_flops: float | None = None, model_bytes: float | None = None,
                    calls: int = 1, looped: bool = False) -> dict:
    """The plan's view of a compiled program that ran here (``rlhf_jax.plan.report.program_cost``): its roofline
    seconds for ``calls`` calls on this chip, the FLOPs and bytes it counts (XLA's, or the model's arithmetic where
    XLA gives none or counts a loop's body once: ``looped``) and the memory the program holds per device. The one
    place the prediction column comes from."""
    import jax

    try:
        from rlhf_jax.plan.report import program_cost
        from rlhf_jax.parallel.chips import chip_of
    except ImportError as e:
        return {"available": False, "reason": f"rlhf_jax.plan not importable ({e})"}
    device = jax.devices()[0]
    chip = chip_of(device)
    cost = program_cost(name, compiled, chip, calls=calls, model_flops=model_flops, model_bytes=model_bytes,
                        looped=looped)
    return {"available": cost.roofline_s is not None, "chip": chip.name if chip else None,
            "reason": None if chip else f"no chip figures for {device.device_kind!r} in rlhf_jax.plan.targets",
            "roofline_s": cost.roofline_s, "program_bytes": cost.program_bytes, "flops": cost.flops,
            "bytes_accessed": cost.bytes_accessed, "source": cost.source, "calls": calls}


def chip_peaks() -> tuple[float | None, float | None]:
    """(peak bf16 FLOP/s, HBM bytes/s) of this device: the plan's chip table, else the trainer's MFU table."""
    import jax

    try:
        from rlhf_jax.parallel.chips import chip_of

        chip = chip_of(jax.devices()[0])
        if chip is not None:
            return chip.peak_flops, chip.hbm_bytes_per_s
    except ImportError:
        pass
    from rlhf_jax.train.metrics import PEAK_FLOPS

    kind = jax.devices()[0].device_kind.lower()
    return next((v for k, v in PEAK_FLOPS.items() if k.lower() in kind), None), None


# ----------------------------------------------------------------------------- run + report
def run(sizes: Sizes, sections: set[str], log=print) -> dict:
    import jax

    from benchmarks import accelerator_grpo as G
    from benchmarks import accelerator_moe as M
    from benchmarks import accelerator_parts as P

    device = jax.devices()[0]
    peak_flops, bandwidth = chip_peaks()
    result: dict = {"device": device.device_kind, "platform": device.platform, "device_count": jax.device_count(),
                    "jax_version": jax.__version__, "smoke": sizes is SMOKE, "sizes": dataclasses.asdict(sizes),
                    "peak_flops": peak_flops, "hbm_bytes_per_s": bandwidth, "seconds": {}}

    def section(name, fn):
        """Run one section; a failure (a kernel that does not lower, memory) is recorded and the next one runs."""
        if name not in sections:
            return
        start = time.perf_counter()
        log(f"[{name}] ...", flush=True)
        try:
            result[name] = fn()
        except Exception as e:  # noqa: BLE001 - reported in the table and the JSON, the run goes on
            traceback.print_exc()
            result.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:2000]
        result["seconds"][name] = time.perf_counter() - start

    section("parity", lambda: P.logits_parity(MODELS["tiny-qwen2"], sizes.parity_tokens))

    def update():
        rows = []
        for model in sizes.update_models:
            for remat in (False, True):
                r = P.update_throughput(MODELS[model], remat, sequences=sizes.sequences, prompt_len=sizes.prompt_len,
                                        response_len=sizes.response_len, row_len=sizes.row_len,
                                        rows_per_micro=sizes.rows_per_micro, repeats=sizes.repeats,
                                        predict=plan_prediction)
                r.update(model=model, remat=remat, mfu=r["flops_per_s"] / peak_flops if peak_flops else None)
                rows.append(r)
        return rows

    section("update", update)

    def decode():
        hf, rows = MODELS[sizes.decode_model], []
        for slots in sizes.slots:
            ours = P.sampler_decode(hf, slots, prompt_len=sizes.decode_prompt_len, new_tokens=sizes.new_tokens,
                                    repeats=sizes.repeats, predict=plan_prediction)
            theirs = P.transformers_generate(hf, slots, prompt_len=sizes.decode_prompt_len, new_tokens=sizes.new_tokens)
            roofline = slots / (ours["decode_step_bytes"] / bandwidth) if bandwidth else None
            rows.append({**ours, "model": sizes.decode_model, "transformers": theirs,
                         "ratio_to_transformers": ours["tokens_per_s"] / theirs["tokens_per_s"],
                         "hbm_roofline_tokens_per_s": roofline,
                         "fraction_of_hbm_roofline": ours["tokens_per_s"] / roofline if roofline else None})
        return rows

    section("decode", decode)
    section("grpo_step", lambda: {"model": sizes.grpo_model, **G.grpo_step(
        MODELS[sizes.grpo_model], prompts=sizes.grpo_prompts, n=sizes.grpo_n, prompt_len=sizes.grpo_prompt_len,
        new_tokens=sizes.grpo_new_tokens, row_len=sizes.row_len, rows_per_micro=sizes.rows_per_micro,
        predict=plan_prediction)})
    tokens, experts, hidden, width, top_k = sizes.moe
    section("moe", lambda: M.moe_products(tokens=tokens, experts=experts, hidden=hidden, width=width, top_k=top_k,
                                          repeats=sizes.repeats))
    result["table"] = table_rows(result)
    return result


def _predicted(plan: dict | None, amount: float | None = None) -> tuple[str, float | None]:
    """(the prediction column's text, its seconds) of a plan entry; ``amount`` / seconds gives a rate."""
    if not plan or not plan.get("available"):
        return "n/a", None
    seconds = plan["roofline_s"]
    return (f"{amount / seconds:,.0f}/s" if amount else f"{seconds:.3g} s"), seconds


def table_rows(result: dict) -> list[dict]:
    """One row per measurement: what, measured, the plan's prediction and their ratio, notes."""
    rows = []
    for r in result.get("parity", []):
        rows.append({"section": "a parity", "case": f"logits {r['dtype']} vs transformers ({r['torch_device']})",
                     "measured": f"max|diff| {r['max_abs_diff']:.2e}", "predicted": f"tol {r['tolerance']:.1e}",
                     "ratio": None, "note": "ok" if r["within_tolerance"] else "OUT OF TOLERANCE"})
    for r in result.get("update", []):
        text, seconds = _predicted(r["plan"], r["tokens"])
        mfu = f", MFU {r['mfu']:.1%}" if r.get("mfu") is not None else ""
        rows.append({"section": "b update", "case": f"{r['model']} remat {'on' if r['remat'] else 'off'}",
                     "measured": f"{r['tokens_per_s']:,.0f} tok/s{mfu}", "predicted": text,
                     "ratio": seconds / r["seconds"] if seconds else None,
                     "note": f"{r['tokens']} tokens, {r['micro_batches']} micro x {r['rows_per_micro']} x {r['row_len']}"})
    for r in result.get("decode", []):
        text, seconds = _predicted(r["plan"], r["generated_tokens"])
        roof = r.get("fraction_of_hbm_roofline")
        rows.append({"section": "c decode", "case": f"{r['model']} {r['slots']} slots x {r['new_tokens']}",
                     "measured": f"{r['tokens_per_s']:,.0f} tok/s", "predicted": text,
                     "ratio": seconds / r["seconds"] if seconds else None,
                     "note": f"transformers {r['transformers']['tokens_per_s']:,.0f} tok/s "
                             f"({r['ratio_to_transformers']:.2f}x)" + (f", {roof:.0%} of HBM roofline" if roof else "")})
    for name, error in result.get("errors", {}).items():
        rows.append({"section": name, "case": "FAILED", "measured": error.splitlines()[0][:100], "predicted": "-",
                     "ratio": None, "note": "see the JSON's errors"})
    g = result.get("grpo_step")
    if g:
        for stage, seconds in g["stages_s"].items():
            text, predicted = _predicted(g["plan"].get(stage))
            rows.append({"section": "d grpo", "case": f"{g['model']} {g['prompts']}x{g['n']} {stage}",
                         "measured": f"{seconds:.3g} s", "predicted": text,
                         "ratio": predicted / seconds if predicted else None,
                         "note": f"{g['real_tokens']} tokens" if stage == "update_actor" else ""})
    for r in result.get("moe", []):
        case = f"{r['implementation']}{' (chosen here)' if r.get('chosen_here') else ''}"
        if "error" in r:
            rows.append({"section": "e moe", "case": case, "measured": r["error"].splitlines()[0][:100],
                         "predicted": "-", "ratio": None, "note": "failed"})
            continue
        rows.append({"section": "e moe", "case": f"{case}: {r['tokens']} tokens x {r['top_k']} of {r['experts']}",
                     "measured": f"{r['tokens_per_s']:,.0f} tok/s, {r['routed_flops_per_s'] / 1e12:.3g} TFLOP/s",
                     "predicted": "n/a", "ratio": None,
                     "note": f"fwd+bwd, hidden {r['hidden']}, width {r['width']}; outputs apart "
                             f"{r.get('max_abs_diff_between', float('nan')):.1e} (relative)"})
    return rows


def print_table(result: dict) -> None:
    print(f"\n{result['device']} ({result['platform']}), jax {result['jax_version']}"
          + (" [smoke]" if result["smoke"] else ""))
    head = ("section", "case", "measured", "plan predicts", "plan/measured", "note")
    rows = [(r["section"], r["case"], r["measured"], r["predicted"],
             f"{r['ratio']:.2f}" if r["ratio"] is not None else "-", r["note"]) for r in result["table"]]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in (head, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())


def device_slug(kind: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") or "device"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (< 2 minutes)")
    ap.add_argument("--sections", nargs="+", default=["parity", "update", "decode", "grpo_step", "moe"],
                    choices=["parity", "update", "decode", "grpo_step", "moe"])
    ap.add_argument("--json", default=None, help="output path (default benchmarks/results/accelerator_<device>.json)")
    args = ap.parse_args(argv)

    import jax

    start = time.perf_counter()
    result = run(SMOKE if args.smoke else FULL, set(args.sections))
    result["seconds"]["total"] = time.perf_counter() - start
    print_table(result)
    suffix = "_smoke" if args.smoke else ""
    path = args.json or os.path.join(REPO, "benchmarks", "results",
                                     f"accelerator_{device_slug(jax.devices()[0].device_kind)}{suffix}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=float)
    print(f"wrote {path} ({result['seconds']['total']:.0f} s)")
    return 1 if result.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
