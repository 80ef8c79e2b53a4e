"""``benchmarks/accelerator.py --smoke``: the accelerator benchmark's code, tiny sizes, on the CPU, in a subprocess."""

import json
import os
import subprocess
import sys

import pytest

from tests.train.helpers import REPO

# Run the script with these packages absent (an accelerator machine may lack them): importing one fails.
ABSENT = ("grain", "ml_collections", "tensorboardX", "array_record")
BOOT = f"""
import importlib.abc, importlib.machinery, runpy, sys
class Absent(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name.split(".")[0] in {ABSENT!r} else None
    def create_module(self, spec):
        raise ImportError(spec.name + " is not installed here")
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, Absent())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
STAGES = {"gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "step"}
PLAN_KEYS = {"available", "reason"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("accelerator") / "result.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")  # one device
    proc = subprocess.run([sys.executable, "-c", BOOT, os.path.join(REPO, "benchmarks", "accelerator.py"), "--smoke",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    result["stdout"] = proc.stdout
    return result


def test_smoke_run_measures_every_section(smoke):
    assert smoke["smoke"] and smoke["platform"] == "cpu" and smoke["device_count"] == 1
    parity = {r["dtype"]: r for r in smoke["parity"]}
    assert set(parity) == {"float32", "bfloat16"}
    for r in parity.values():  # ours against transformers on the same random checkpoint
        assert r["within_tolerance"] and r["argmax_agreement"] > 0.9, r
    assert parity["float32"]["max_abs_diff"] < 1e-4 < parity["bfloat16"]["max_abs_diff"]

    assert {(r["model"], r["remat"]) for r in smoke["update"]} == {("tiny-qwen2", False), ("tiny-qwen2", True)}
    for r in smoke["update"]:
        assert r["tokens"] == 4 * (16 + 48) and r["tokens_per_s"] > 0 and r["flops_per_s"] > 0
        assert r["mfu"] is None  # no peak FLOP/s for a CPU
        assert PLAN_KEYS <= set(r["plan"])
        # the prediction column must not need what an accelerator machine may lack
        assert not any(name in (r["plan"]["reason"] or "") for name in ABSENT), r["plan"]["reason"]
        if "program_bytes" in r["plan"]:  # rlhf_jax.plan importable: its counts of the program that ran
            assert r["plan"]["program_bytes"] > 0 and r["plan"]["flops"] > 0

    assert [r["slots"] for r in smoke["decode"]] == [4, 8]
    for r in smoke["decode"]:
        # ignore_eos: every slot decodes to the end, on both sides
        assert r["generated_tokens"] == r["transformers"]["generated_tokens"] == r["slots"] * 16
        assert r["tokens_per_s"] > 0 and r["ratio_to_transformers"] > 0 and r["decode_step_bytes"] > r["weight_bytes"]
        assert r["hbm_roofline_tokens_per_s"] is None  # no HBM bandwidth for a CPU

    g = smoke["grpo_step"]
    assert set(g["stages_s"]) == STAGES and all(t >= 0 for t in g["stages_s"].values())
    assert g["response_tokens"] == 2 * 2 * 8 and g["grad_norm"] > 0
    assert set(g["plan"]) == {"gen", "old_log_prob", "ref", "update_actor"}

    moe = {r["implementation"]: r for r in smoke["moe"]}
    assert set(moe) == {"ragged", "blocked"} and moe["blocked"]["chosen_here"] and not moe["ragged"]["chosen_here"]
    for r in moe.values():  # the same products in another order, bfloat16
        assert r["tokens"] == 64 and r["tokens_per_s"] > 0 and r["max_abs_diff_between"] < 2e-2, r

    # the table: one row per measurement, printed
    assert [r["section"] for r in smoke["table"]].count("d grpo") == len(STAGES)
    assert "plan predicts" in smoke["stdout"] and "c decode" in smoke["stdout"] and "e moe" in smoke["stdout"]
