"""The tools around launch (generate, eval, hf import/export/check, convert, ckpt, and plan,
fp8_check, restart_bench and bench) read their flags alike: an unknown or abbreviated flag is one
line naming it (before a missing required one), exit status 2; a count of 0 or less is refused
unless 0 means something the help says; --help stays whole. And generate and eval find a run's
tokenizer as tools.hf export does once its converted data is gone: in the HF directories the
model came from, else one line naming the data."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import types

import pytest

from mimo_jax import configfile
from mimo_jax.config import ConfigError
from tools import bench as bench_tool
from tools import ckpt as ckpt_tool
from tools import convert as convert_tool
from tools import fp8_check as fp8_check_tool
from tools import eval as eval_tool
from tools import generate as generate_tool
from tools import hf as hf_tool
from tools import plan as plan_tool
from tools import restart_bench as restart_bench_tool

ROOT = pathlib.Path(__file__).resolve().parents[1]
LLAVA = ROOT / "tests" / "fixtures" / "recipe" / "llava"


def _refused(main, argv: list[str], capsys) -> str:
  """The one line `main(argv)` prints on stderr as it exits with status 2 (raised or returned)."""
  try:
    status = main(argv)
  except SystemExit as e:
    status = e.code
  err = capsys.readouterr().err
  assert status == 2 and len(err.strip().splitlines()) == 1, (status, err)
  assert "usage:" not in err, err
  return err.strip()


@pytest.mark.parametrize("main,argv,said", [
    (generate_tool.main, ["run", "--imgae", "x"], "tools.generate: error: unrecognized "
     "arguments: --imgae x (--help lists the flags)."),
    (generate_tool.main, ["run", "--prompt", "hi", "--temp", "0.5"], "--temp 0.5"),
    (generate_tool.main, ["run", "--prompt", "hi", "--max", "2"], "--max 2"),
    (generate_tool.main, ["--imgae"], "unrecognized arguments: --imgae "),
    (eval_tool.main, ["run", "--dat", "x"], "tools.eval: error: unrecognized arguments: --dat "),
    (eval_tool.main, ["run", "--data", "x", "--sample", "2"], "--sample 2"),
    (hf_tool.main, ["export", "run", "--outt", "x"],
     "tools.hf: error: unrecognized arguments: --outt "),
    (hf_tool.main, ["export", "run", "--out", "x", "--stp", "3"], "--stp 3"),
    (hf_tool.main, ["export", "run", "--out", "x", "--peft", "--tok", "t"], "--tok t"),
    (hf_tool.main, ["import", "--hf", "x", "--outt", "y"], "unrecognized arguments: --outt "),
    (hf_tool.main, ["import", "--hf", "x", "--out", "y", "--conf=c.py"], "--conf=c.py"),
    (hf_tool.main, ["check", "--hff", "x"], "unrecognized arguments: --hff "),
    (hf_tool.main, ["--outt"], "unrecognized arguments: --outt "),
    (convert_tool.main, ["--seqlen", "256"], "tools.convert: error: unrecognized arguments: --seqlen "),
    (convert_tool.main, ["--jso", "x", "--images", "i", "--tokenizer", "t", "--out", "o"],
     "unrecognized arguments: --jso "),
    (ckpt_tool.main, ["inspect", "run", "--st", "3"],
     "tools.ckpt: error: unrecognized arguments: --st 3 "),
    (ckpt_tool.main, ["export", "run", "--ou", "x"], "unrecognized arguments: --ou "),
    (ckpt_tool.main, ["chek", "run"], "invalid choice: 'chek'"),
    (plan_tool.main, ["--gpus", "2", "--max", "2"], "plan: error: unrecognized arguments: --max 2"),
    (bench_tool.main, ["--layouts=x", "--step=1"],
     "bench: error: unrecognized arguments: --step=1"),
    (fp8_check_tool.main, ["--seed", "1"], "fp8_check: error: unrecognized arguments: --seed 1"),
    (restart_bench_tool.main, ["--restart", "1"], "unrecognized arguments: --restart 1"),
])
def test_an_unknown_or_abbreviated_flag_is_named_in_one_line(main, argv, said, capsys):
  err = _refused(main, argv, capsys)
  assert said in err and err.endswith("(--help lists the flags)."), err


def test_an_import_override_is_not_an_unknown_flag(capsys):
  # --config.a.b=v is import's own: the flag missing beside it is the error.
  err = _refused(hf_tool.main, ["import", "--hf", "x", "--config.data.seq_len=8"], capsys)
  assert err == ("tools.hf: error: the following arguments are required: --out (--help lists "
                 "the flags)."), err


@pytest.fixture(name="data")
def _data(tmp_path) -> str:
  path = tmp_path / "data.json"
  path.write_text("[]")
  return str(path)


@pytest.mark.parametrize("flag,value,said", [
    ("--batch", "0", "--batch 0: give a positive number."),
    ("--batch", "-1", "--batch -1: give a positive number."),
    ("--samples", "-2", "--samples -2: give a positive number (0: all samples)."),
    ("--seq_len", "0", "--seq_len 0: give a positive number."),
    ("--cpu_devices", "0", "--cpu_devices 0: give a positive number."),
    ("--max_new_tokens", "0", "--max_new_tokens 0: give a positive number."),
    ("--step", "-1", "--step -1: give a step of the run, 0 or more."),
    ("--batch", "two", "--batch two: not an integer."),
])
def test_eval_refuses_a_count_below_its_least(data, flag, value, said, capsys):
  err = _refused(eval_tool.main, ["run", "--data", data, flag, value], capsys)
  assert err == f"tools.eval: error: {said}", err


def test_eval_keeps_samples_0_as_all_and_says_so(data, capsys):
  # pylint: disable-next=protected-access
  args = eval_tool._args(["run", "--data", data, "--samples", "0"])
  with pytest.raises(ConfigError, match="run: no such directory"):  # the flags pass
    eval_tool.check_flags(args)
  with pytest.raises(SystemExit):
    eval_tool.main(["--help"])
  assert "the first N samples (0 = all)" in capsys.readouterr().out


@pytest.mark.parametrize("main,argv,said", [
    (generate_tool.main, ["run", "--prompt", "hi", "--max_new_tokens", "0"],
     "tools.generate: error: --max_new_tokens 0: give at least 1."),
    (generate_tool.main, ["run", "--prompt", "hi", "--max_new_tokens", "x"],
     "tools.generate: error: --max_new_tokens x: not an integer."),
    (generate_tool.main, ["run"], "tools.generate: error: give --prompt TEXT, or --image FILE or "
     "--audio FILE."),
    (hf_tool.main, ["export", "run", "--out", "x", "--step", "-1"],
     "tools.hf: error: --step=-1: must be at least 0."),
    (convert_tool.main, ["--json", "j", "--images", "i", "--tokenizer", "t", "--out", "o",
                         "--workers", "two"], "tools.convert: error: --workers two: not an integer."),
    (hf_tool.main, ["export", "run", "--out", "x", "--base", "b"], "tools.hf: error: --base=b "
     "names a PEFT adapter's base model: give it with --peft, or leave it out."),
    (ckpt_tool.main, ["inspect", "run", "--step", "-2"],
     "tools.ckpt: error: --step=-2: must be at least 0."),
    (ckpt_tool.main, ["check", "run", "--step", "abc"], "tools.ckpt: error: --step=abc: not an "
     "integer."),
    (ckpt_tool.main, ["export", "run"], "tools.ckpt: error: the following arguments are "
     "required: --out (--help lists the flags)."),
    (ckpt_tool.main, ["export", "run", "--out", f"{__file__}/x.st"], "tools.ckpt: error: --out: "
     f"{__file__} is a file, not a folder, so nothing can be made under it; choose another "
     "--out."),
    (convert_tool.main, ["--json", "j", "--images", "i", "--tokenizer", "t", "--out", ""],
     "tools.convert: error: --out '': empty; give a path (an unset shell variable gives an empty "
     "one)."),
    (hf_tool.main, ["import", "--hf", "h", "--out", " "], "tools.hf: error: --out=' ': empty; "
     "give a path (an unset shell variable gives an empty one)."),
    (hf_tool.main, ["export", "run", "--out="], "tools.hf: error: --out='': empty; give a path "
     "(an unset shell variable gives an empty one)."),
    (ckpt_tool.main, ["export", "run", "--out", "/proc/x.st"], "tools.ckpt: error: --out="
     "'/proc/x.st' is on a file system that stores no files (/proc); choose another --out."),
])
def test_other_bad_values_are_one_line(main, argv, said, capsys):
  assert _refused(main, argv, capsys) == said


_LAYOUT = "--layouts=vision=0/1/1,language=0/1/1"


@pytest.mark.parametrize("argv,said", [
    ([_LAYOUT, "--steps=0"], "--steps=0: must be at least 1."),
    ([_LAYOUT, "--steps=-1", "--warmup=-2"], "--steps=-1: must be at least 1."),
    ([_LAYOUT, "--warmup=-2"], "--warmup=-2: must be at least 0."),
    ([_LAYOUT, "--profile_steps=-1"], "--profile_steps=-1: must be at least 0."),
    ([_LAYOUT, "--peak=0"], "--peak=0: must be more than 0."),
    ([_LAYOUT, "--json=/nonexistent/dir/x.json"], "--json=/nonexistent/dir/x.json: folder "
     "/nonexistent/dir does not exist; make it or name another file."),
    ([_LAYOUT, f"--json={__file__}/x.json"], f"--json={__file__}/x.json: {__file__} is a "
     "file, not a folder, so nothing can be made under it; name another file."),
    ([_LAYOUT, "--json=/proc/x.json"], "--json='/proc/x.json' is on a file system that stores no "
     "files (/proc); choose another --json."),
    (["--layouts="], "--layouts=: names no layout; give one or more, ';'-separated, each "
     "module=offset/dp/tp[/pp[/virtual]] (e.g. --layouts=vision=0/1/1,language=0/1/1)."),
    (["--layouts= ; "], "--layouts= ; : names no layout; "),
])
def test_bench_refuses_a_bad_flag_before_any_work(argv, said, capsys):
  err = _refused(bench_tool.main, ["--config=configs/digits.py", *argv], capsys)
  assert err.startswith(f"bench: error: {said}"), err


@pytest.mark.parametrize("argv,said", [
    (["--steps=0"], "--steps=0: must be at least 1."),
    (["--warmup=-1"], "--warmup=-1: must be at least 0."),
    (["--top=0"], "--top=0: must be at least 1."),
    (["--json=/nonexistent/dir/x.json"], "--json=/nonexistent/dir/x.json: folder "
     "/nonexistent/dir does not exist"),
    (["--stepz=1"], "unrecognized arguments: --stepz=1"),
])
def test_kernels_refuses_a_bad_flag_before_any_work(argv, said, capsys):
  # tools.kernels took them, ran its steps and the trace, then failed or wrote nothing.
  from tools import kernels  # pylint: disable=import-outside-toplevel
  err = _refused(kernels.main, ["--config=configs/digits.py", *argv], capsys)
  assert err.startswith(f"kernels: error: {said}"), err


@pytest.mark.parametrize("main,argv,shown", [
    (generate_tool.main, ["--help"], ["--max_new_tokens MAX_NEW_TOKENS", "--top_p TOP_P",
                                      "[--pad_to_square | --no-pad_to_square]",
                                      "Loads WORKDIR's newest"]),
    (eval_tool.main, ["--help"], ["--data DATA", "--batch BATCH", "--cpu_devices CPU_DEVICES"]),
    (hf_tool.main, ["--help"], ["{import,export,check}", "`check` (needs torch"]),
    (hf_tool.main, ["export", "--help"], ["[--step STEP] --out OUT", "--overwrite"]),
    (hf_tool.main, ["import", "--help"], ["--hf HF --out OUT [--config CONFIG]"]),
    (hf_tool.main, ["check", "--help"], ["--hf HF [--dtype {float32,bfloat16}]"]),
    (convert_tool.main, ["--help"], ["--json JSON [--images IMAGES]", "--audio_window"]),
    (ckpt_tool.main, ["--help"], ["{inspect,export,check}", "python -m tools.ckpt inspect"]),
    (ckpt_tool.main, ["export", "--help"], ["[--step STEP] --out OUT dir"]),
])
def test_help_is_whole(main, argv, shown, capsys):
  with pytest.raises(SystemExit) as e:
    main(argv)
  out = capsys.readouterr().out
  assert e.value.code == 0 and out.startswith("usage: python -m tools."), out
  for text in shown:
    assert text in " ".join(out.split()), (text, out)


@pytest.fixture(name="run")
def _run(tmp_path, monkeypatch):
  """A workdir (no checkpoint read: its config is served as its step 0's) whose run names the
  converted data `tmp_path/gone`, which is not there; its hf_import.json, where written, names
  the LLaVA fixture. Reading the tokenizer's vocabulary stops the tool, the tokenizer noted."""
  cfg = configfile.load("configs/llava_cpu.py", [f"--config.data.dir={tmp_path / 'gone'}",
                                                 "--config.data.image_token=5"])
  work = tmp_path / "run"
  (work / "checkpoints").mkdir(parents=True)

  class Reader:
    def __init__(self, workdir):
      del workdir
    note = close = lambda *a: None
    meta = lambda self, step: {"config": dataclasses.asdict(cfg)}
  newest = lambda reader, step, load, tool: (0, load(0))
  monkeypatch.setattr(generate_tool, "checkpoint_reader",
                      types.SimpleNamespace(Reader=Reader, newest=newest))
  monkeypatch.setattr(eval_tool, "run_config", lambda args: (0, cfg))
  opened = []

  def stop(tok, *_):
    opened.append(str(tok.path))
    raise ConfigError("stopped at the vocabulary")
  monkeypatch.setattr(generate_tool, "check_vocab", stop)
  return work, tmp_path / "gone", opened


def _imported(work: pathlib.Path) -> None:
  (work / "hf_import.json").write_text(json.dumps(
      {"sources": {"vision": str(LLAVA), "language": str(LLAVA)}, "image_token_index": 5}))


def test_without_its_data_a_run_finds_the_tokenizer_it_was_imported_with(run, data, capsys):
  work, gone, opened = run
  _imported(work)
  assert generate_tool.main([str(work), "--prompt", "hi"]) == 2
  assert eval_tool.main([str(work), "--data", data]) == 2
  assert opened == [str(LLAVA)] * 2
  err = capsys.readouterr().err
  assert err.count(f"its run's data directory {gone} is missing: the tokenizer and processor "
                   "are the HF directories' it came from") == 2, err
  assert err.count("stopped at the vocabulary") == 2, err
  found = generate_tool.defaults(str(work), configfile.load(
      "configs/llava_cpu.py", [f"--config.data.dir={gone}"]))
  assert found["processor"] == str(LLAVA) and found["gone"] == str(gone)


def test_without_its_data_or_an_import_the_error_names_the_data(run, data, capsys):
  work, gone, opened = run
  said = (f"{work}: its run's data directory {gone} is missing (moved or deleted) and no import "
          "names a directory with tokenizer.json; give --tokenizer DIR (or put the data back).")
  assert _refused(generate_tool.main, [str(work), "--prompt", "hi"], capsys) == \
      f"tools.generate: error: {said}"
  assert _refused(eval_tool.main, [str(work), "--data", data], capsys) == \
      f"tools.eval: error: {said}"
  assert not opened


def test_a_figures_file_replaces_only_the_tools_own_figures_and_is_written_whole(
    tmp_path, capsys):
  from tools import common  # pylint: disable=import-outside-toplevel
  mine = tmp_path / "precious.txt"
  mine.write_text("precious\n")
  with pytest.raises(SystemExit):
    common.figures_file("bench", "--json", str(mine))
  assert capsys.readouterr().err == (f"bench: error: --json={mine}: exists and holds no figures "
                                     "of tools.bench; choose another --json or remove it.\n")
  out = tmp_path / "bench.json"
  common.figures_file("bench", "--json", str(out))  # new: fine
  common.write_figures("bench", str(out), {"rows": [1]})
  assert json.loads(out.read_text()) == {"tool": "bench", "rows": [1]}
  assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "precious.txt"]
  with pytest.raises(SystemExit):
    common.figures_file("bench", "--json", str(out))  # {"rows"} alone: not a bench file
  common.write_figures("bench", str(out), {"config": "c", "set": [], "rows": []})
  common.figures_file("bench", "--json", str(out))  # its own figures: replaced
  out.write_text(json.dumps({"config": "c", "set": [], "rows": []}))
  common.figures_file("bench", "--json", str(out))  # and those written before they named it
  with pytest.raises(SystemExit):
    common.figures_file("kernels", "--json", str(out))  # another tool's
