"""The README's main command: the default config trains on the digits task (through the
conversation data path) past its accuracy bar, and the README's generation example answers as the
README shows."""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _run(module, *args):
  # As a user runs it: the default XLA flags, not the suite's faster-compiling ones.
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True,
                        text=True, env=dict(env, JAX_PLATFORMS="cpu"), timeout=900)


def test_the_default_run_names_held_out_digits_and_answers_as_the_readme_shows(tmp_path,
                                                                               data_dir):
  workdir = tmp_path / "digits"
  proc = _run("mimo_jax.launch", f"--config.run.workdir={workdir}",
              f"--config.data.dir={data_dir}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  final = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines()][-1]
  assert final["step"] == 600 and final["eval_digits"] == 938
  claimed = float(re.search(r"the model names about (\d+)% of", README).group(1)) / 100
  assert final["eval_accuracy"] >= claimed - 0.02, final  # the README's bar, within run spread

  block = README[README.index("python -m tools.generate runs/digits"):]
  command = shlex.split(block[:block.index("```")].replace("\\\n", " "))
  assert command[:3] == ["python", "-m", "tools.generate"]
  shown = block[block.index("```\n>") + 4:]
  shown = shown[:shown.index("```")].strip()
  args = [str(workdir) if a == "runs/digits" else a for a in command[3:]]
  proc = _run("tools.generate", *args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.strip() == shown
  # The images' own labels, in their names.
  assert shown.splitlines()[-1] == " ".join(
      re.search(r"eval-\d+-(\w+)\.png", a).group(1) for a in args if a.endswith(".png"))
