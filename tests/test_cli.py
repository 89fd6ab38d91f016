"""`python -m mimo_jax.launch`: errors are one line with exit code 2; a tiny run writes outputs."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _launch(*args, cwd=None):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "mimo_jax.launch", *args], cwd=cwd or ROOT,
                        capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.parametrize("args,needle", [
    (["--config.train.stepz=3"], "stepz"),
    (["--config.train.steps=abc"], "train.steps"),
    (["--config.topology.language.dp=3"], "config.topology.language.dp"),
    (["--config=configs/nope.py"], "nope.py"),
    (["--config=configs/digits.py:bogus"], ": configs/digits.py: unknown variant 'bogus'; use"),
    (["--confg.train.steps=3"], "'confg.train.steps'; a config field is --config.train.steps="),
    (["stray"], "stray"),
    # Converted data that is not there is named first (not the fields its launch line sets).
    (["--config.data.task=conversations", "--config.data.dir=/nonexistent/llava"],
     "config.data.dir: /nonexistent/llava not found"),
])
def test_bad_flags_are_one_line_errors(tmp_path, args, needle):
  workdir = tmp_path / "run"
  proc = _launch(*args, f"--config.run.workdir={workdir}" if "stepz" not in args[0] and
                 "confg" not in args[0] else "")
  assert proc.returncode == 2, proc.stderr
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
  assert len(lines) == 1 and lines[0].startswith("mimo_jax: error: "), proc.stderr
  assert needle in lines[0]
  assert not workdir.exists()  # nothing written


def test_tiny_run_writes_metrics_and_tensorboard(tmp_path, data_dir):
  workdir = tmp_path / "run"
  proc = _launch(
      f"--config.run.workdir={workdir}", f"--config.data.dir={data_dir}",
      "--config.train.steps=4", "--config.run.log_every=2", "--config.eval.every=2",
      "--config.eval.samples=32", "--config.eval.batch=16", "--config.data.train_samples=2000",
      "--config.data.eval_samples=200", "--config.model.language.layers=1",
      "--config.model.vision.layers=1", cwd=tmp_path)  # also: the default config from any cwd
  assert proc.returncode == 0, proc.stderr[-3000:]
  records = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in records if "loss" in r]
  evals = [r for r in records if "eval_loss" in r]
  assert [r["step"] for r in train] == [2, 4]
  assert [r["step"] for r in evals] == [2, 4]
  for r in train:
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "step_time_s"):
      assert isinstance(r[key], float) and r[key] == r[key], key
  assert 0.0 <= evals[-1]["eval_accuracy"] <= 1.0
  assert any(p.name.startswith("events") for p in (workdir / "tb").iterdir())
  assert "topology: vision: dp=4" in proc.stdout
  # Programs cached where jax was told (the suite's own directory, not ~/.cache); the run's start.
  assert f"compilation cache: {os.environ['JAX_COMPILATION_CACHE_DIR']}" in proc.stdout
  assert "time to first step: " in proc.stdout and "step 4 ended " in proc.stdout
  # Where the data is read from, said at every start (built before, or now).
  assert f"data: digits from {data_dir}/digits-v2-n2000-e200-" in proc.stdout, proc.stdout


def test_help_exits_0_and_helpfull_shows_the_named_config():
  """--help (absl's, which exits 1) exits 0: asking for help is no failure. --helpfull lists the
  defaults of the config --config names, not configs/digits.py's."""
  proc = _launch("--help")
  assert proc.returncode == 0 and "--heartbeat_timeout" in proc.stdout, proc.stderr
  proc = _launch("--config=configs/llava_cpu.py", "--helpfull")
  assert proc.returncode == 0, proc.stderr
  assert "config fields (defaults of configs/llava_cpu.py;" in proc.stdout
  assert "--config.topology.language.dp=1  (int)" in proc.stdout  # digits.py's is 2
