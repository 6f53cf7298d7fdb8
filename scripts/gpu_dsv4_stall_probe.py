#!/usr/bin/env python3
"""A DeepSeek-V4 decode with host experts left running, looked at: decode steps recorded with
the host part as calls on the stream (the default) once stalled at batch 32 on the whole
V4-Flash (a launch waiting on the device, which waited on the launching thread; see
`kernels/cuda/graph_launcher.rs`). This starts `troupe generate` on ROWS prompts of the
V4-Flash shape cut to LAYERS layers (`--dummy-weights`, FLAGS passed on), waits up to WAIT
seconds, and if it is still running prints each thread's state and kernel wait channel (and
gdb's backtraces where gdb exists) and the GPU's utilization; then counts of the trace
events and its log's tail (`PROBE_LOG`: the log filter, say
`troupe=info,troupe::model::deepseek_v4=trace,troupe::kernels::cuda::host_calls=trace`).

Usage (on the device machine): python3 scripts/gpu_dsv4_stall_probe.py ROWS WAIT LAYERS [FLAGS...]
"""

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpu_dsv4 import command, shape  # noqa: E402


def threads(pid: int) -> None:
    for t in sorted(os.listdir(f"/proc/{pid}/task")):
        d = f"/proc/{pid}/task/{t}"
        try:
            comm = open(d + "/comm").read().strip()
            wchan = open(d + "/wchan").read().strip()
            fields = open(d + "/stat").read().split(")")[1].split()
            print(t, comm, fields[0], wchan, "utime", fields[11])
        except OSError as e:
            print(t, e)


def main() -> None:
    rows, wait, layers, flags = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    rng = random.Random(0)
    model = shape(layers)
    tmp = Path(tempfile.mkdtemp())
    (tmp / "m").mkdir()
    (tmp / "m" / "config.json").write_text(json.dumps(
        dict(model, model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"])))
    batch = [[rng.randrange(2, model["vocab_size"]) for _ in range(512)] for _ in range(rows)]
    cmd = command("gpu-bin/troupe", tmp / "m", batch, 8, tmp, 4096, flags)
    env = dict(os.environ, RUST_LOG=os.environ.get("PROBE_LOG", "troupe=info"))
    log = tmp / "err"
    p = subprocess.Popen(cmd, stdout=open(tmp / "out", "w"), stderr=open(log, "w"), env=env)
    t0 = time.time()
    while p.poll() is None and time.time() - t0 < wait:
        time.sleep(2)
    print("exit code" if p.poll() is not None else "still running", p.poll(), f"{time.time() - t0:.0f} s")
    stats = tmp / "stats.json"
    print(stats.read_text()[:600] if stats.exists() else "no stats")
    if p.poll() is None:
        threads(p.pid)
        gdb = shutil.which("gdb")
        if gdb:
            out = subprocess.run([gdb, "-p", str(p.pid), "-batch", "-ex", "thread apply all bt 12"],
                                 capture_output=True, text=True, timeout=60)
            print(out.stdout[-9000:])
        subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv"])
        p.kill()
    lines = log.read_text().splitlines()
    for what in ["recorded=true", "recorded=false", "recorded step launched", "host calls served",
                 "host call started"]:
        print(what, sum(what in line for line in lines))
    print("\n".join(lines[-40:])[-6000:])


if __name__ == "__main__":
    main()
