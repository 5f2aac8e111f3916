"""N JAX processes on this machine as one multi-process job: what a GPU node or TPU pod runs, on
CPU devices, so that the multi-process paths can be tested without a cluster.

    python -m bebop.local_cluster --processes 2 [--devices_per_process 2] -- \\
        --config configs/demo.py:runlocal --workdir W

Starts `launch.py` N times with `distributed.coordinator_address=127.0.0.1:<free port>`,
`num_processes=N`, `process_id=i`, CPU devices only (`XLA_FLAGS=
--xla_force_host_platform_device_count=<devices_per_process>`, so N x that many global devices)
and gloo CPU collectives. Every line a process prints is forwarded with the prefix `[pK] `
(stdout to stdout, stderr to stderr). When one process exits with an error (or is killed), the
others get SIGTERM, then SIGKILL after `--shutdown_timeout_s`; the launcher exits with the failing
process's code (128 + signal for a signal) and its error as the last line of stderr. SIGTERM or
SIGINT to the launcher is passed on to every process (a preemption: they save and exit 143). A
second SIGTERM is not escalated -- `timeout` and job schedulers send SIGTERM to the launcher and
its process group, so one request to stop can arrive twice -- while a second SIGINT (Ctrl-C
twice) kills them; SIGKILL the launcher to kill everything (its processes die with it). The
processes are started with `setsid` (their own process group), so signals to the launcher's
process group reach them only through the launcher. The launcher's first stderr line names each
process's pid.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEVICE_FLAG = "--xla_force_host_platform_device_count"


def free_port() -> int:
    """A TCP port nobody listens on now (the coordinator binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(devices: int, base: dict | None = None) -> dict:
    """The environment of one process: CPU only, `devices` fake devices (an inherited device
    count, e.g. the test suite's 8, is replaced), gloo collectives."""
    env = dict(os.environ if base is None else base)
    flags = re.sub(rf"{DEVICE_FLAG}=\S+", "", env.get("XLA_FLAGS", "")).split()
    env["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_FLAG}={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"
    env["PYTHONUNBUFFERED"] = "1"  # lines arrive as they are printed, in order
    return env


def launch_command(launch_args: list[str], port: int, n: int, i: int) -> list[str]:
    dist = [
        f"--config.distributed.coordinator_address=127.0.0.1:{port}",
        f"--config.distributed.num_processes={n}",
        f"--config.distributed.process_id={i}",
    ]
    return [sys.executable, str(REPO / "launch.py"), *launch_args, *dist]


def _die_with_parent() -> None:
    """Linux: a process whose launcher is gone (SIGKILLed) gets SIGKILL too, not orphaned."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Cluster:
    """The N processes, their forwarded output and the first failure."""

    def __init__(self, launch_args: list[str], n: int, devices: int, port: int | None = None):
        self.n, self.port = n, port or free_port()
        env = process_env(devices)
        self.procs = [
            subprocess.Popen(
                launch_command(launch_args, self.port, n, i),
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                preexec_fn=_die_with_parent,
                start_new_session=True,  # group signals reach them through `on_signal` only
            )
            for i in range(n)
        ]
        self.last_err = [""] * n  # each process's last non-empty stderr line
        self.signals = 0
        self.signum = 0  # the signal passed on to the processes (0: none yet)
        pids = ", ".join(f"p{i}={p.pid}" for i, p in enumerate(self.procs))
        print(f"local_cluster: {n} processes on port {self.port}: {pids}", file=sys.stderr)
        self._lock = threading.Lock()
        self.threads = []
        for i, p in enumerate(self.procs):
            for stream, sink in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                t = threading.Thread(target=self._pump, args=(i, stream, sink), daemon=True)
                t.start()
                self.threads.append(t)

    def _pump(self, i: int, stream, sink) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            with self._lock:  # a progress bar's "\r" redraws start with the prefix too
                sink.write(f"[p{i}] " + line.replace("\r", f"\r[p{i}] ") + "\n")
                sink.flush()
                if sink is sys.stderr and line.strip():
                    self.last_err[i] = line.strip().split("\r")[-1]
        stream.close()

    def signal_all(self, signum: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)

    def on_signal(self, signum: int, frame=None) -> None:
        """The first SIGTERM / SIGINT is passed on; a second SIGINT kills, a second SIGTERM is
        the same request again (the processes are already saving): it changes nothing."""
        self.signals += 1
        if self.signals == 1:
            self.signum = signum
            self.signal_all(signum)
        elif signum == signal.SIGINT:
            self.signal_all(signal.SIGKILL)
        else:
            print("local_cluster: SIGTERM again; the processes are saving", file=sys.stderr)

    def wait(self, shutdown_timeout_s: float) -> tuple[int, int | None]:
        """(exit code, index of the failing process or None). Polls until every process is done
        or one failed; then the rest get SIGTERM and, after the timeout, SIGKILL."""
        failed = None
        while failed is None:
            codes = [p.poll() for p in self.procs]
            # After a forwarded SIGTERM / SIGINT, a process that stopped as asked (128 + the
            # signal) is done, not failed: its peers are still saving and get no signal again
            # (one that arrives while a process shuts down would kill it).
            done = {0} | ({128 + self.signum} if self.signum else set())
            bad = [i for i, c in enumerate(codes) if c is not None and c not in done]
            if bad:  # seen together: a killed process is the cause, its peers' errors follow
                failed = min(bad, key=lambda i: (codes[i] > 0, i))
            elif all(c is not None for c in codes):
                break
            else:
                time.sleep(0.05)
        if failed is not None:
            self.signal_all(signal.SIGTERM)
            deadline = time.monotonic() + shutdown_timeout_s
            while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
                time.sleep(0.05)
            self.signal_all(signal.SIGKILL)
            for p in self.procs:
                p.wait()
        for t in self.threads:
            t.join(timeout=5)
        if failed is None:
            return max(p.returncode for p in self.procs), None
        rc = self.procs[failed].returncode
        return (128 - rc if rc < 0 else rc), failed

    def failure_line(self, i: int) -> str:
        rc = self.procs[i].returncode
        if rc < 0:
            how = f"was killed by {signal.Signals(-rc).name}"
        else:
            how = f"exited with code {rc}"
        last = self.last_err[i]
        return f"error: process {i} of {self.n} {how}" + (f": {last}" if last else "")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--" in argv:
        split = argv.index("--")
        own, launch_args = argv[:split], argv[split + 1 :]
    else:
        own, launch_args = argv, []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--processes", type=int, default=2, help="JAX processes (default 2)")
    p.add_argument("--devices_per_process", type=int, default=2, help="CPU devices each")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument(
        "--shutdown_timeout_s",
        type=float,
        default=10.0,
        help="after a failure, SIGKILL the others this long after SIGTERM",
    )
    args = p.parse_args(own)
    if args.processes < 1 or args.devices_per_process < 1:
        p.error("--processes and --devices_per_process must be >= 1")
    if not any(a == "--config" or a.startswith("--config=") for a in launch_args):
        p.error("launch.py arguments go after '--' and need --config")
    cluster = Cluster(launch_args, args.processes, args.devices_per_process, args.port)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, cluster.on_signal)
    rc, failed = cluster.wait(args.shutdown_timeout_s)
    if failed is not None:
        print(cluster.failure_line(failed), file=sys.stderr, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
