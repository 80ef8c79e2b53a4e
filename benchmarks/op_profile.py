"""Where a compiled program's time goes, op by op: a ``jax.profiler`` trace of a few calls, each XLA:CPU thunk's
time summed over the calls and the executor's threads, named by the compiled HLO.

    from benchmarks.op_profile import op_profile
    print(op_profile(jitted_fn, *args, calls=3))

Thread time, not wall time: a library call (a ``ynn_fusion`` dot) that both threads work on counts once on the
thread that runs it. The report lists the op kinds (fusion name without its number) and the heaviest single ops
with their HLO line, which carries the jax source op (``op_name=...``). It found, for example, that XLA:CPU's
library fusion of a multiply-then-reduce over the vocabulary took 0.8 s of a 4 s SmolLM2 update micro-batch.
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile

# Executor bookkeeping events that span the ops themselves.
_SPANS = {"ThunkExecutor::Execute", "SlinkyThreadPool::Await", "ThunkExecutor::Execute (wait for completion)"}


def hlo_lines(hlo_text: str) -> dict[str, str]:
    """Instruction name -> the rest of its HLO line (first definition wins)."""
    lines = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*)", line)
        if m and m.group(1) not in lines:
            lines[m.group(1)] = m.group(2)
    return lines


def op_profile(fn, *args, calls: int = 3, top: int = 15, width: int = 200) -> str:
    """A text report of ``fn(*args)``'s op times (ms per call); ``fn`` is a ``jax.jit`` function, compiled here."""
    import jax
    from jax._src.lib import _profile_data

    jax.block_until_ready(fn(*args))
    names = hlo_lines(fn.lower(*args).compile().as_text())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
        data = _profile_data.ProfileData.from_file(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
        per_op: collections.Counter = collections.Counter()
        for plane in data.planes:
            for line in plane.lines:
                if not line.name.startswith("tf_XLAEigen"):  # the executor's threads
                    continue
                for event in line.events:
                    if event.name not in _SPANS:
                        per_op[event.name] += event.duration_ns / 1e6 / calls
    kinds: collections.Counter = collections.Counter()
    for name, ms in per_op.items():
        kinds[re.sub(r"\.\d+$", "", name)] += ms
    out = [f"thread time per call: {sum(per_op.values()):.1f} ms over {len(per_op)} ops", "by kind:"]
    out += [f"  {ms:9.1f} ms  {kind}" for kind, ms in kinds.most_common(top)]
    out.append("heaviest ops:")
    out += [f"  {ms:9.1f} ms  {name}: {names.get(name, '?')[:width]}" for name, ms in per_op.most_common(top)]
    return "\n".join(out)
