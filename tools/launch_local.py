"""Start N local processes of `python -m mimo_jax.launch`, as on N hosts.

  python -m tools.launch_local -n 2 [--devices_per_process 4] [--gpus] -- [launch flags ...]

Each process gets `--coordinator=127.0.0.1:PORT --num_processes=N --process_id=I`; on CPU each
creates `--devices_per_process` devices (`run.cpu_devices`), with `--gpus` each sees one GPU
(CUDA_VISIBLE_DEVICES=I). Output lines are prefixed with `[I]`. If one process fails or is killed,
the others are ended and the launcher names it and exits with its status (128 + the signal for a
killed one); of processes that ended together, it names one a signal ended, the likelier cause.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from mimo_jax.config_run import MAX_CPU_DEVICES  # run.cpu_devices' bound (no JAX imported)




class _Parser(argparse.ArgumentParser):
  """argparse's refusals as one line, status 2, without the usage block (as the other tools)."""

  def error(self, message: str):
    print(f"{self.prog}: error: {message} (--help lists the flags).", file=sys.stderr, flush=True)
    sys.exit(2)


def _count(least: int, most: int | None = None):
  """An argparse type: an integer in least..most."""
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < least or (most is not None and value > most):
      raise argparse.ArgumentTypeError(
          f"{value}: must be {f'in {least}..{most}' if most else f'at least {least}'}")
    return value
  return parse


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _pump(index: int, stream, out) -> None:
  for line in iter(stream.readline, ""):
    out.write(f"[{index}] {line}")
    out.flush()


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if "--" in argv:
    split = argv.index("--")
    own, launch_args = argv[:split], argv[split + 1:]
  else:
    own, launch_args = argv, []
  parser = _Parser(prog="python -m tools.launch_local", description=__doc__, allow_abbrev=False,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("-n", "--num_processes", type=_count(1), required=True)
  parser.add_argument("--devices_per_process", type=_count(1, MAX_CPU_DEVICES), default=4,
                      help="CPU devices each process creates (run.cpu_devices, "
                      f"1..{MAX_CPU_DEVICES})")
  parser.add_argument("--gpus", action="store_true", help="one GPU per process")
  args = parser.parse_args(own)
  port = _free_port()
  procs, pumps = [], []
  for i in range(args.num_processes):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.gpus:
      env["CUDA_VISIBLE_DEVICES"] = str(i)
    else:
      env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [sys.executable, "-m", "mimo_jax.launch", f"--coordinator=127.0.0.1:{port}",
           f"--num_processes={args.num_processes}", f"--process_id={i}"]
    extra = [] if args.gpus else [f"--config.run.cpu_devices={args.devices_per_process}"]
    # After the user's flags: the last value of a field wins (mimo_jax/configfile.py).
    proc = subprocess.Popen(cmd + launch_args + extra, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    procs.append(proc)
    print(f"[launch_local] process {i}: pid {proc.pid}", flush=True)
    pump = threading.Thread(target=_pump, args=(i, proc.stdout, sys.stdout), daemon=True)
    pump.start()
    pumps.append(pump)

  def failures() -> list[tuple[int, int]]:
    """(index, status) of the processes that failed, those a signal ended first: where two end
    between two looks, the one killed is the likelier cause of the other's error."""
    failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode not in (None, 0)]
    return sorted(failed, key=lambda f: f[1] >= 0)

  def stop_all(sig=signal.SIGTERM) -> None:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, sig)

  signal.signal(signal.SIGTERM, lambda *_: stop_all())
  status = 0
  try:
    while any(p.poll() is None for p in procs):
      failed = failures()
      if failed:
        i, rc = failed[0]
        print(f"[launch_local] process {i} {_ended(rc)}; ending the others",
              file=sys.stderr, flush=True)
        status = rc if rc > 0 else 128 - rc
        stop_all()
        deadline = time.time() + 10
        while time.time() < deadline and any(p.poll() is None for p in procs):
          time.sleep(0.1)
        stop_all(signal.SIGKILL)
        break
      time.sleep(0.1)
  except KeyboardInterrupt:
    stop_all(signal.SIGINT)  # each process checkpoints its last finished step
  for p in procs:
    p.wait()
  for t in pumps:
    t.join(timeout=5)
  if status == 0 and failures():  # every process ended between two looks
    i, rc = failures()[0]
    print(f"[launch_local] process {i} {_ended(rc)}", file=sys.stderr, flush=True)
    status = rc if rc > 0 else 128 - rc
  return status


def _ended(rc: int) -> str:
  """How a process ended, from its return code: a negative one is the signal that killed it."""
  if rc < 0:
    try:
      return f"was killed by {signal.Signals(-rc).name} (status {128 - rc})"
    except ValueError:
      return f"was killed by signal {-rc} (status {128 - rc})"
  return f"exited with status {rc}"


if __name__ == "__main__":
  sys.exit(main())
