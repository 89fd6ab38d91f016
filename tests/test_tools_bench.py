"""The MFU formula, smoke runs of tools/bench.py (with tools/plan.py on its profile) and of the
other measuring tools (the encoder, bridge and data benches, the fp8 check, tools.kernels' HLO
tracing; the norm and attention benches' and the hf_llava peer's flags), their one-line errors
and CPU devices; speed is measured on GPUs, never asserted here. The planner's own tests are in
tests/test_tools_plan.py."""

import importlib
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mimo_jax import encoders
from mimo_jax.flops import FlopModel
from mimo_jax.modules import build_modules
from tests.configs import tiny_vlm
from tools import activation_bench as ab
from tools import bench, encoder_bench, hf_llava_bench, hlo_dump, kernels, plan


def _abstract(cfg):
  return {n: m.abstract_params() for n, m in build_modules(cfg).items()}


def test_matmul_parameters_from_the_config_alone():
  cfg = tiny_vlm.get_config("encoder_heavy")
  v, lm = cfg.model.vision, cfg.model.language
  fm = FlopModel.build(cfg, _abstract(cfg))
  patch = v.patch_size**2 * v.channels * v.dim + v.layers * (4 * v.dim**2 + 2 * v.dim * v.mlp_dim)
  projector = v.dim * v.downsample**2 * v.projector_hidden + v.projector_hidden * lm.dim
  hd = lm.dim // lm.heads
  layer = 2 * lm.dim * lm.heads * hd + 2 * lm.dim * lm.kv_heads * hd + 3 * lm.dim * lm.mlp_dim
  assert encoders.get("vision").matmul_params(fm.params["vision"]) == (patch, projector)
  assert fm.language_params == lm.layers * layer + lm.dim * lm.vocab_size


def test_step_flops_count_real_samples_only():
  cfg = tiny_vlm.get_config("encoder_heavy")
  v, lm = cfg.model.vision, cfg.model.language
  fm = FlopModel.build(cfg, _abstract(cfg))
  # Two samples of 7 and 4 positions (the rest of their rows is padding), and an empty one.
  work = {"vision": {"patches": np.array([2 * v.patches]),
                     "patches_sq": np.array([2 * v.patches**2])}}
  batch = types.SimpleNamespace(stats=types.SimpleNamespace(work=work),
                                samples=types.SimpleNamespace(tokens_b=np.array([[7, 4, 0]])))
  got = fm.step(batch)
  lang = lambda n: 6 * fm.language_params * n + 12 * lm.layers * lm.dim * n * (n + 1) / 2
  patch, projector = encoders.get("vision").matmul_params(fm.params["vision"])
  image = (6 * (patch * v.patches + projector * v.tokens_per_image)
           + 12 * v.layers * v.patches * v.dim * v.patches)
  assert got["language"] == pytest.approx(lang(7) + lang(4))
  assert got["vision"] == pytest.approx(2 * image)


def test_bench_and_plan_run_end_to_end(tmp_path, capsys):
  """One non-colocated layout through tools/bench.py on CPU devices, then tools/plan.py on it."""
  out = tmp_path / "bench.json"
  layout = "vision=0/2/1,language=2/2/1"
  bench.main(["--config=tests/configs/tiny_vlm.py", f"--set=data.dir={tmp_path}",
              f"--layouts={layout}", "--warmup=1", "--steps=2", "--profile_steps=1",
              f"--json={out}"])
  row = json.loads(out.read_text())["rows"][0]
  # The steady step: the interval between the two steps' ends, within the window's 2 steps.
  assert 0 < row["step_median_s"] < 2 * row["step_s"]
  assert row["layout"] == layout and row["gpus"] == 4
  assert row["bridge_bytes"] > 0 and row["bridge_gbps"] > 0 and row["raw_gbps"] > 0
  assert row["busy_vision_s"] > 0 and row["busy_language_s"] > 0
  assert 0 < row["flops_vision"] < row["flops_total"] and np.isfinite(row["loss"])
  # Its step program compiled once for the one batch shape of the tiny data, before step 1 ended.
  assert len(row["compile_s_per_shape"]) == 1 and row["compile_s"] >= row["compile_s_per_shape"][0]
  assert row["time_to_first_step_s"] > row["compile_s_per_shape"][0] > 0
  printed = capsys.readouterr().out
  assert layout in printed and "| first step s | compile s/shape |" in printed
  assert f"| {row['time_to_first_step_s']:.1f} | 1 × " in printed
  plan.main([f"--profile={out}", "--gpus=4", "--max_tp=1", f"--measured={out}"])
  printed = capsys.readouterr().out
  assert "recommended:" in printed and "| vision=0/2/1,language=2/2/1 | non-colocated |" in printed
  assert "v dp2 profiled; l dp2 profiled" in printed and "v dp4 from dp2" in printed
  assert "no split of the 4 GPUs between the modules can take less than" in printed
  with pytest.raises(SystemExit, match="profile the config being planned"):
    plan.main([f"--profile={out}", "--gpus=4", "--config=tests/configs/tiny_vlm.py:dynamic"])


def test_encoder_bench_runs_split_and_fused(capsys):
  """tools/encoder_bench.py on CPU: one row per remat policy and loop, and the split (the step's
  way) and fused forward and backward give the same gradients."""
  cfg = tiny_vlm.get_config()
  row = encoder_bench.measure(cfg, images=2, reps=1)
  assert row["split_vs_fused"] < 1e-5
  assert all(row[k] > 0 for k in ("forward_s", "split_s", "fused_s", "split_tflops"))
  encoder_bench.main(["--config=tests/configs/tiny_vlm.py", "--images=2", "--reps=1",
                      "--remat=none,dots"])
  rows = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| none |")
          or l.startswith("| dots |")]
  assert len(rows) == 2 * 2 * 2  # each printed as measured, then in the table
  with pytest.raises(SystemExit) as raised:
    encoder_bench.main(["--config=tests/configs/tiny_vlm.py", "--images=2", "--remat=bogus"])
  assert raised.value.code == 2
  assert "encoder_bench: error: config.topology.vision.remat: unknown policy 'bogus'" in \
      capsys.readouterr().err


def test_bench_profiles_a_fused_layout_module_by_module(tmp_path):
  """A colocated dp-only layout trains as one program a microbatch; the profile still reports
  each module's busy time (it runs the modules' separate calls)."""
  out = tmp_path / "bench.json"
  bench.main(["--config=tests/configs/tiny_vlm.py", f"--set=data.dir={tmp_path}",
              "--layouts=vision=0/2/1,language=0/2/1", "--warmup=1", "--steps=1",
              "--profile_steps=1", f"--json={out}"])
  row = json.loads(out.read_text())["rows"][0]
  assert row["busy_vision_s"] > 0 and row["busy_language_s"] > 0
  assert "busy_step_s" not in row and row["bridge_bytes"] == 0
  # The fused step's program compiled ahead in a background thread, once for the one shape.
  assert len(row["compile_s_per_shape"]) == 1
  assert row["time_to_first_step_s"] > row["compile_s_per_shape"][0] > 0


@pytest.mark.parametrize("src,dst,ends", [("0:1", "1:3", "bridge"), ("0:3", "3:1", "bridge"),
                                          ("0:1", "0:2", "bridge"), ("0:1", "1:3", "programs"),
                                          ("0:3", "3:1", "programs"), ("0:2", "1:1", "programs")])
def test_bridge_bench_runs_on_cpu_devices(capsys, src, dst, ends):
  """tools/bridge_bench.py moves and checks the array (fan-out, fan-in, onto a mesh holding the
  source device; pieces cut and joined by the bridge or by the programs at either end) and
  prints one row a size."""
  from tools import bridge_bench  # pylint: disable=import-outside-toplevel
  bridge_bench.main(["--src", src, "--dst", dst, "--sizes_mib", "1", "--reps", "1",
                     "--ends", ends])
  rows = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| 1 |")]
  assert len(rows) == 1
  cells = [float(c) for c in rows[0].strip("|").split("|")]
  assert len(cells) == (6 if ends == "programs" else 4) and all(c > 0 for c in cells[1:])


def test_data_bench_tables_padding_sent_with_pack(data_dir, capsys):
  """tools.data_bench on the tiny config with packed rows and buckets: its fifth table gives the
  row and image fill sent in stream and pack order."""
  from tools import data_bench  # pylint: disable=import-outside-toplevel
  data_bench.main(["--config=tests/configs/tiny.py", f"--set=data.dir={data_dir}",
                   "--set=data.seq_len=48", "--set=data.pack_rows=10", "--set=data.row_buckets=10",
                   "--set=data.slot_buckets=4", "--set=data.microbatches=4", "--workers=0",
                   "--dps=2", "--steps=1", "--fill_steps=6"])
  out = capsys.readouterr().out
  fill = {m.group(1): (float(m.group(2)), float(m.group(3)))
          for m in re.finditer(r"^\| (stream|pack) \| ([\d.]+)% \| ([\d.]+)% \|", out, re.M)}
  assert set(fill) == {"stream", "pack"}, out
  assert fill["pack"][0] > fill["stream"][0], fill


def test_fp8_check_tables_runs_against_the_bfloat16_spread(tmp_path):
  from tools import fp8_check  # pylint: disable=import-outside-toplevel
  run = tmp_path / "run"
  run.mkdir()
  (run / "metrics.jsonl").write_text(
      '{"step": 10, "loss": 2.0}\n{"step": 20, "loss": 1.5}\n{"step": 20, "eval_loss": 1.25, '
      '"eval_accuracy": 0.5}\n')
  assert fp8_check.last_metrics(run) == {"loss": 1.5, "eval_loss": 1.25, "eval_accuracy": 0.5}
  rows = {"bfloat16": [(0, {"loss": 1.0, "eval_loss": 1.0, "eval_accuracy": 0.5}),
                       (1, {"loss": 3.0, "eval_loss": 1.0, "eval_accuracy": 0.7})],
          "fp8": [(0, {"loss": 4.0, "eval_loss": 1.5, "eval_accuracy": 0.6}),
                  (1, {"loss": 4.0, "eval_loss": 1.5, "eval_accuracy": 0.6})]}
  table = fp8_check.summary(rows).splitlines()
  assert table[4] == ("| bfloat16 | mean ± sd | 2.0000 ± 1.4142 | 1.0000 ± 0.0000 | "
                      "0.6000 ± 0.1414 |")
  # loss: (4 − 2) / 1.4142; eval_loss: no bfloat16 spread; eval_accuracy: equal means.
  assert table[-1] == "| fp8 − bfloat16 | in bfloat16 sd | +1.41 | – | +0.00 |"
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "x").write_text("")
  with pytest.raises(SystemExit):
    fp8_check.main(["--out", str(tmp_path / "out")])
  with pytest.raises(SystemExit):
    fp8_check.main(["--seeds", "0", "--out", str(tmp_path / "new")])


@pytest.mark.parametrize("flag,module", [("--fp8", "torchao"), ("--liger", "liger_kernel")])
def test_hf_llava_bench_names_the_missing_package_of_an_option(flag, module):
  """The peer's options need packages torch does not bring: a missing one ends the tool before
  torch loads, with the line that installs it."""
  if importlib.util.find_spec(module) is not None:
    pytest.skip(f"{module} is installed here")
  with pytest.raises(SystemExit, match=rf"{flag} needs the {module} package.*pip install"):
    hf_llava_bench.main([flag])



@pytest.mark.parametrize("value", ["0", "-25", "last"])
def test_hf_llava_bench_refuses_a_feature_layer_outside_the_tower(value, capsys):
  """--feature_layer counts the tower's 24 layers from the end: anything else is one line."""
  with pytest.raises(SystemExit) as stop:
    hf_llava_bench.main(["--feature_layer", value])
  assert stop.value.code == 2
  assert f"'{value}': give -24 to -1" in capsys.readouterr().err

_TRACED = """import sys
from tools import hlo_dump
hlo_dump.dump_hlo(sys.argv[1])
import jax
import jax.numpy as jnp
def inner(x):
  return jnp.sin(x) * 2  # line 7
def outer(x):
  return jnp.sum(inner(x) + 1)
jax.jit(outer)(jnp.ones((64, 64)))
"""


def test_kernels_trace_to_the_source_lines_through_the_dumped_hlo(tmp_path):
  """tools.kernels --hlo: XLA's dump of a real program is read back, an emitted kernel (named
  after its instruction, '.' written '_') is traced to the line that made it and its model
  file, a library kernel to neither; a directory holding files already is refused."""
  script, dump = tmp_path / "traced.py", tmp_path / "hlo"
  script.write_text(_TRACED)
  root = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, str(script), str(dump)], check=True, cwd=root, env=env,
                 timeout=120)
  hlo = hlo_dump.read_hlo(str(dump))
  sine = [(name, i) for name, i in hlo["jit_outer"].items() if i.op == "jit(outer)/sin"]
  assert sine, "the sine's instruction is in the dumped program"
  name, found = sine[0]
  assert found.bytes == 2 * 64 * 64 * 4  # reads x once, writes sin(x) once
  assert hlo_dump.source(found.frames) == "traced.py:7 inner"
  assert [f.rsplit(" ", 1)[1] for f in found.frames[:2]] == ["inner", "outer"]
  events = [{"ph": "X", "pid": 1, "name": n, "dur": d, "args": {"hlo_module": "jit_outer"}}
            for n, d in ((name.replace(".", "_"), 3e5), ("nvjet_sm90_gemm", 1e6))]
  summary = kernels.summarize(events, {1: "/device:GPU:0"}, hlo)
  assert summary["sources"][0] == {"source": hlo_dump.UNTRACED, "s": 1.0, "example": "",
                                   "bytes": 0}
  assert summary["sources"][1]["source"] == "traced.py:7 inner"
  assert summary["sources"][1]["s"] == pytest.approx(0.3)
  assert summary["sources"][1]["bytes"] == 32768
  kind = kernels.category(name.replace(".", "_"), "")
  assert summary["parts"] == {"(library kernels) / matmul": 1.0, f"traced.py / {kind}": 0.3}
  assert {k["name"]: k["bytes"] for k in summary["kernels"]} == {
      name.replace(".", "_"): 32768, "nvjet_sm90_gemm": 0}
  text = kernels.report(summary, 1, 1.3, 5)
  assert "| `traced.py:7 inner` |" in text
  assert "| `nvjet_sm90_gemm` | matmul | 1 | 1.0000 | 76.9% | – | – |" in text
  with pytest.raises(SystemExit, match="holds files already"):
    hlo_dump.dump_hlo(str(dump))


def test_kernels_idle_is_the_time_no_kernel_runs_on_any_stream():
  """The gaps between kernels, streams merged (an overlap is no gap), summed by the programs
  around them, the longest first; host events and other devices' kernels do not count."""
  def kernel(ts, dur, name, prog, pid=1):
    return {"ph": "X", "pid": pid, "ts": ts, "dur": dur, "name": name,
            "args": {"hlo_module": prog}}
  events = [kernel(0, 100, "a", "jit_step"), kernel(50, 100, "b", "jit_step"),  # overlap
            kernel(170, 10, "c", "jit_step"),  # 20 us after b's end
            kernel(1180, 20, "d", "jit_update"),  # 1000 us after c
            kernel(1200, 5, "e", "jit_update"),  # touching: no gap
            kernel(300, 900, "host", "jit_step", pid=2), kernel(5000, 1, "x", "?", pid=3)]
  gaps = kernels.idle(events, {1})
  assert gaps["idle_s"] == pytest.approx(1020e-6)
  assert gaps["span_s"] == pytest.approx(1205e-6)
  assert gaps["by_programs"] == pytest.approx({"jit_step -> jit_update": 1000e-6,
                                               "jit_step -> jit_step": 20e-6})
  assert [(g["after"], g["before"]) for g in gaps["longest"]] == [
      ("c (jit_step)", "d (jit_update)"), ("b (jit_step)", "c (jit_step)")]
  summary = kernels.summarize(events, {1: "/device:GPU:0", 2: "/host:CPU"})
  assert summary["idle"] == gaps
  text = kernels.report(summary, 1, 0.01, 3)
  assert "idle between kernels: 0.0010 s/step (84.6% of the traced span)" in text
  assert "| 1.000 | `c (jit_step)` | `d (jit_update)` |" in text
  # Two devices each on its own: one's kernels do not fill the other's gaps.
  other = [kernel(t, 50, "k", "jit_step", pid=4) for t in (50, 150)]
  both = kernels.idle(events + other, {1, 4})
  assert both["idle_s"] == pytest.approx(1070e-6) and both["span_s"] == pytest.approx(1355e-6)
  assert kernels.idle([], {1}) == {"idle_s": 0.0, "span_s": 0.0, "by_programs": {},
                                   "longest": []}
  assert "idle between" not in kernels.report(kernels.summarize([], {1: "/device:GPU:0"}), 1,
                                              0.01, 3)


def test_kernels_keeps_command_buffers_by_an_xla_flag_beside_the_users(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/x")
  kernels.keep_command_buffers()
  assert os.environ["XLA_FLAGS"] == (
      "--xla_dump_to=/x --xla_enable_command_buffers_during_profiling=true")


def test_norm_bench_refuses_bad_flags_and_a_machine_without_a_gpu():
  """tools.norm_bench: each is one line (tests/test_norm_kernels.py checks the kernels)."""
  from tools import norm_bench
  for flags, said in ((["--rows", "3"], "--rows '3': give powers of two"),
                      (["--shapes", "48x576"], "--shapes '48x576': give images x positions"),
                      (["--repeat", "0"], "--repeat 0: give 1 or more"),
                      ([], "needs a GPU")):
    with pytest.raises(SystemExit, match=said):
      norm_bench.main(flags)


def test_attention_bench_reads_its_shapes_and_refuses_bad_ones():
  """tools.attention_bench: grouped-query and causal shapes parse; a bad one is one line."""
  from tools import attention_bench
  assert attention_bench.parse_shape("16x2048x32x64/8c") == (16, 2048, 32, 64, 8, True)
  assert attention_bench.parse_shape("48x576x16x64") == (48, 576, 16, 64, 16, False)
  assert attention_bench.flops(1, 4, 2, 8, causal=True) == 3.5 * 4 * 16 * 2 * 8 / 2
  for flags, said in ((["--shapes", "48x576x16"], "--shapes '48x576x16': give rows x positions"),
                      (["--shapes", "2x8x3x8/2"], "--shapes '2x8x3x8/2': give sizes of 1 or more"),
                      (["--repeat", "0"], "--repeat 0: give 1 or more"),
                      (["--repeats", "2"], "unrecognized arguments: --repeats"),
                      ([], "needs a GPU")):
    with pytest.raises(SystemExit, match=said):
      attention_bench.main(flags)


def test_kernels_count_the_layer_norm_kernels_as_fusions():
  """The Pallas LayerNorm kernels (models/norm_kernels.py) are memory-bound norms, as XLA's
  fusions of them are: a category of their own would hide them from the fusions they replace."""
  for name in ("layer_norm_forward", "layer_norm_backward__1"):
    assert kernels.category(name, "") == "fusion"
  assert kernels.category("some_custom_kernel", "") == "other"


def test_kernels_count_the_bytes_of_an_instructions_operands_and_results(tmp_path):
  """tools.kernels --hlo: an instruction moves its results and its operands once each; an
  operand `%t#k` is the k-th array of a tuple, a whole tuple counts all of them; an operand
  that a fusion only slices counts the slice; an instruction that two programs of one name
  give different shapes has no bytes (the trace cannot say which ran)."""
  program = """HloModule jit_t
%c2 (q0: bf16[4], q1: f32[8], q2: f8e4m3fn[8]) -> f32[8] {
  %q0 = bf16[4]{0} parameter(0)
  %q1 = f32[8]{0} parameter(1)
  %q2 = f8e4m3fn[8]{0} parameter(2)
  %s = f32[2]{0} slice(%q1), slice={[0:2]}
  ROOT %r = f32[8]{0} pad(%s, %q0), padding=0_6
}

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %t = (f32[8]{0}, bf16[4]{0}) custom-call(%p), custom_call_target="x"
  %g = f8e4m3fn[8]{0} fusion(%t), kind=kLoop, calls=%c1
  ROOT %f = f32[8]{0} fusion(%t#1, %p, /*index=2*/%g), kind=kLoop, calls=%c2, metadata={op_name="jit(t)/mul"}
}
"""
  (tmp_path / "a").mkdir()
  (tmp_path / "a" / "m.after_optimizations.txt").write_text(program)
  moved = {n: i.bytes for n, i in hlo_dump.read_hlo(str(tmp_path / "a"))["jit_t"].items()}
  assert moved["p"] == 32 and moved["t"] == 32 + 8 + 32 and moved["g"] == 8 + 40
  assert moved["f"] == 32 + 8 + 8 + 8  # of p's 32 bytes, the fusion reads the 8 it slices
  (tmp_path / "a" / "n.after_optimizations.txt").write_text(
      program.replace("ROOT %f = f32[8]{0}", "ROOT %f = f32[16]{0}"))
  merged = hlo_dump.read_hlo(str(tmp_path / "a"))["jit_t"]
  assert (merged["f"].bytes, merged["f"].op, merged["g"].bytes) == (0, "jit(t)/mul", 48)
  assert hlo_dump.shape_bytes("(bf16[16,2]{1,0}, f32[3]{0}, pred[], s8[2,2])") == [64, 12, 1, 4]


_CASES = [  # (tool, argv, words of the one line)
    ("data_bench", ["--config=configs/digits.py", "--set", "model.layer_norm=bogus"],
     ["config.model.layer_norm: must be auto, xla or pallas, got 'bogus'"]),
    ("data_bench", ["--config=configs/digits.py", "--set", "optim.lr=nan"],
     ["config.optim.lr: must be a finite number"]),
    ("kernels", ["--set", "model.layer_norm=bogus"], ["config.model.layer_norm"]),
    ("kernels", ["--set", "model.layer_norm=pallas"], ["model.layer_norm", "pallas"]),
    ("kernels", ["--set", "model.nope=1"], ["--set model.nope=1: unknown config field 'nope'"]),
    ("kernels", ["--set", "train.steps=x"], ["--set train.steps=x: not an int."]),
    ("kernels", ["--set", "optim.lr"], ["--set optim.lr: needs a value: --set optim.lr=VALUE."]),
    ("bench", ["--layouts=vision=0/1/1,language=0/1/1", "--set", "model.nope=1"],
     ["--set model.nope=1: unknown config field 'nope'"]),
    ("bench", ["--layouts=vision=0/1/1,language=0/1/1;vision=0/9/1,language=0/1/1"],
     ["[vision=0/9/1,language=0/1/1] "]),
    ("plan", ["--config=configs/vlm.py", "--gpus=4", "--set", "model.nope=1"],
     ["--set model.nope=1: "]),
    ("plan", ["--config=configs/digits.py", "--gpus=4", "--profile_layouts", "--set",
              "data.global_batchh=3"], ["--set data.global_batchh=3: unknown config field "
                                        "'global_batchh'; config.data has task, seed, "]),
    ("plan", ["--config=configs/av_digits.py", "--gpus=4", "--profile_layouts"],
     ["--config=configs/av_digits.py has encoders vision, audio; tools.plan places one encoder "
      "(vision) and the language model", "python -m tools.bench --layouts="]),
    ("plan", ["--config=configs/avlm.py:audio", "--gpus=4", "--layouts_only"],
     ["--config=configs/avlm.py:audio has encoders audio; tools.plan places one encoder"]),
    ("encoder_bench", ["--config=tests/configs/tiny_vlm.py", "--set", "model.nope=1"],
     ["--set model.nope=1: "]),
    ("fp8_check", ["--set", "optim.lr=inf", "--out", "/nonexistent/fp8_check_never_made"],
     ["config.optim.lr: must be a finite number"]),
    ("restart_bench", ["--set", "model.nope=1"], ["--set model.nope=1: "]),
]


@pytest.mark.parametrize("tool,argv,words", _CASES, ids=[f"{c[0]}-{c[1][-1]}" for c in _CASES])
def test_a_measuring_tools_bad_config_is_one_line_naming_the_flag_as_typed(tool, argv, words,
                                                                          capsys):
  """--set overrides and the config they make are checked before any work: one line
  `tool: error: ...`, exit status 2, the flag as the user typed it (not --config.a.b=value)."""
  module = importlib.import_module(f"tools.{tool}")
  with pytest.raises(SystemExit) as raised:
    module.main(argv)
  assert raised.value.code == 2
  out, err = capsys.readouterr()
  assert "Traceback" not in err and "--config." not in err, err
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"{tool}: error: "), err
  for w in words:
    assert w in lines[0], (w, lines[0])
  assert "compiling" not in out, out


_AV = "--layouts=vision=0/2/1,audio=2/1/1,language=3/2/1"  # spans 5 devices


def test_bench_makes_run_cpu_devices_on_cpu_as_launch_does():
  """On a CPU backend tools.bench starts JAX with run.cpu_devices devices (not JAX's one), and a
  layout past them says how to get more. A process of its own: this one's devices are chosen."""
  root = pathlib.Path(__file__).resolve().parents[1]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  done = subprocess.run([sys.executable, "-m", "tools.bench", "--config=configs/av_digits.py",
                         "--set", "run.cpu_devices=4", _AV], cwd=root, capture_output=True,
                        text=True, env=dict(env, PYTHONPATH=str(root), JAX_PLATFORMS="cpu"),
                        timeout=120, check=False)
  assert done.returncode == 2 and done.stderr.strip().splitlines() == [
      "bench: error: [vision=0/2/1,audio=2/1/1,language=3/2/1] config.topology.language.offset: "
      "devices [3, 5) run past the 4 devices available; lower offset or dp*tp*pp; the layout "
      "spans 5 devices: --set run.cpu_devices=5 makes that many on CPU."], done.stderr


def test_bench_says_how_to_get_cpu_devices_where_the_process_chose_its_own(capsys):
  # This process's 8 CPU devices were chosen (tests/conftest.py) before the config was read.
  with pytest.raises(SystemExit) as raised:
    bench.main(["--config=configs/av_digits.py", "--set", "run.cpu_devices=2",
                _AV.replace("language=3/2/1", "language=5/4/1")])
  assert raised.value.code == 2
  assert capsys.readouterr().err.strip().endswith(
      "devices [5, 9) run past the 8 devices available; lower offset or dp*tp*pp; the layout "
      "spans 9 devices: this process's CPU backend has 8, chosen before run.cpu_devices=2 could "
      "apply: start JAX with jax_num_cpu_devices=9.")


def test_activation_bench_forms_are_one_function_and_bad_flags_are_one_line():
  """tools.activation_bench: each form it times computes the code's activation (bfloat16 within
  its rounding of the code's in float32); a bad flag or a machine without a GPU is one line."""
  k = jax.random.split(jax.random.key(0), 4)
  h, dy, gate, up = (jax.random.normal(key, (2, 8, 64), jnp.bfloat16) for key in k)
  bias = 0.1 * jax.random.normal(k[0], (64,))
  for fn, reference, xs in ((ab.sigmoid_gelu_tanh(bias), ab.code_gelu_tanh(bias), (h,)),
                            (ab.exp_swiglu, ab.code_swiglu, (gate, up))):
    assert ab.distance(fn, reference, xs, dy) < 1e-2
  for flags, said in ((["--gelu", "48x576"], "--gelu '48x576': give images x positions x width"),
                      (["--repeat", "0"], "--repeat 0: give 1 or more"), ([], "needs a GPU")):
    with pytest.raises(SystemExit, match=said):
      ab.main(flags)
