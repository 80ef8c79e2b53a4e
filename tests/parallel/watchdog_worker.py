"""One process of a one-process jax.distributed run that watches two pretend peers through the real key-value
store (tests/parallel/test_watchdog.py): ``python -m tests.parallel.watchdog_worker PORT SCENARIO``."""

from __future__ import annotations

import json
import sys
import time

import jax


def main(port: int, scenario: str) -> None:
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=1, process_id=0)
    from jax._src import distributed

    from rlhf_jax.parallel import watchdog

    client = distributed.global_state.client
    left: list[str] = []
    dog = watchdog.Watchdog([0, 1, 2], silence_s=2.0, client=client, process=0, interval_s=0.2,
                            leave=left.append)
    peer = f"{watchdog.PREFIX}/alive/"
    start = time.monotonic()
    if scenario == "abort":  # another process published the stop word
        client.key_value_set(f"{watchdog.PREFIX}/abort", "process 2: step 3: receiving weights from process 0 failed")
    dog.start()
    with dog.doing("step 1: training"):
        while not left and time.monotonic() - start < 8:
            if scenario in ("silent", "done"):
                client.key_value_increment(peer + "2", 1)  # process 2 lives on; process 1 ...
                if scenario == "done" and time.monotonic() - start > 0.5:
                    client.key_value_set(f"{watchdog.PREFIX}/done/1", "1", allow_overwrite=True)  # finished
                elif scenario == "done":
                    client.key_value_increment(peer + "1", 1)
            time.sleep(0.1)
    print(json.dumps({"left": left, "after_s": time.monotonic() - start}), flush=True)
    dog.finish()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
