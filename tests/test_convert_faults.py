"""tools.convert under faults and bad input: two writers of one --out, a full disk, signals,
split sizes, bad records, bad flags and files, image paths out of --images, paths that work from
any directory, and the launch line it ends with."""

import contextlib
import json
import os
import pathlib
import re
import resource
import shlex
import shutil
import signal
import subprocess
import textwrap
import sys
import time

import numpy as np
import pytest
from PIL import Image

from mimo_jax import output, validation, validation_data
from mimo_jax.data import conversations, conversion, conversion_files, digits, llava_json
from mimo_jax.data.chat import ChatTokenizer
from tests.helpers import tiny_config
from tools import convert

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
TOKENIZER = FIXTURES / "chat" / "llama3"
PROCESSOR = FIXTURES / "images" / "siglip"  # 20 x 20
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def _record(i, image="portrait.png", text="What is it?", rid=None):
  r = {"id": f"r{i}" if rid is None else rid,
       "conversations": [{"from": "human", "value": f"<image>\n{text}" if image else text},
                         {"from": "gpt", "value": f"Answer {i}."}]}
  if image:
    r["image"] = image
  return r


def _write(path, records):
  path.write_text("\n".join(json.dumps(r) for r in records))
  return path


@pytest.fixture(scope="module")
def src(tmp_path_factory):
  """images/ (the fixtures' PNGs), a.jsonl (30 one-image records), mid.jsonl (300) and big.jsonl
  (6000, never converted to the end)."""
  root = tmp_path_factory.mktemp("faults")
  (root / "images").mkdir()
  for f in (FIXTURES / "images").glob("*.png"):
    shutil.copy(f, root / "images")
  _write(root / "a.jsonl", [_record(i) for i in range(30)])
  _write(root / "mid.jsonl", [_record(i) for i in range(300)])
  _write(root / "big.jsonl", [_record(i) for i in range(6000)])
  return root


def _args(src, out, *extra, data="a.jsonl", workers="1"):
  return ["--json", str(src / data), "--images", str(src / "images"), "--tokenizer",
          str(TOKENIZER), "--processor", str(PROCESSOR), "--out", str(out), "--workers", workers,
          *extra]


def _main(args, capsys):
  """convert.main in this process: (exit status, stderr, stdout)."""
  try:
    rc = convert.main(args)
  except SystemExit as e:
    rc = e.code
  got = capsys.readouterr()
  return rc, got.err, got.out


def _one_line_error(rc, err, *words):
  assert rc == 2, err
  lines = [ln for ln in err.strip().splitlines() if ln.strip()]
  assert lines[-1].startswith("tools.convert: error: ") and "Traceback" not in err, err
  for w in words:
    assert w in lines[-1], lines[-1]


def _counts(out):
  from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
  return {s: array_record_module.ArrayRecordReader(str(out / f"{s}.array_record")).num_records()
          for s in conversations.SPLITS}


def _leftovers(parent, keep=()):
  return sorted(p.name for p in parent.iterdir() if p.name not in keep)


def _spawn(args, **kw):
  return subprocess.Popen([sys.executable, "-m", "tools.convert", *args], cwd=ROOT, env=ENV,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _wait_for(predicate, proc, timeout=60):
  deadline = time.monotonic() + timeout
  while not predicate():
    assert proc.poll() is None, proc.communicate()
    assert time.monotonic() < deadline
    time.sleep(0.01)


# Two writers, a full disk, signals.

def test_a_second_conversion_into_the_same_out_is_refused_while_the_first_runs(src, tmp_path,
                                                                               capsys):
  out = tmp_path / "out"
  first = _spawn(_args(src, out, data="mid.jsonl"))
  try:  # the first is stopped once it writes, so the second surely overlaps it
    _wait_for(lambda: (tmp_path / ".out.lock").exists() or (out / ".train.array_record.tmp")
              .exists(), first)
    first.send_signal(signal.SIGSTOP)
    rc, err, _ = _main(_args(src, out), capsys)
    _one_line_error(rc, err, "being written by another process", f"pid {first.pid}")
  finally:
    first.send_signal(signal.SIGCONT)
  _, err = first.communicate(timeout=120)
  assert first.returncode == 0, err
  m = conversations.manifest(str(out))
  assert _counts(out) == m["samples"] and sum(m["samples"].values()) == 300
  assert _leftovers(tmp_path) == ["out"]


def test_a_full_disk_stops_the_conversion_at_once_and_leaves_nothing(src, tmp_path):
  """A file size limit (RLIMIT_FSIZE, as a full disk does) refuses the shard's writes: the
  conversion stops within a few records of it, with the reason, and removes what it wrote."""
  proc_dir = tmp_path / "proc"
  proc_dir.mkdir()
  cfg = json.loads((PROCESSOR / "preprocessor_config.json").read_text())
  cfg["size"] = {"height": 512, "width": 512}  # 0.8 MB a record
  (proc_dir / "preprocessor_config.json").write_text(json.dumps(cfg))
  _write(tmp_path / "d.jsonl", [_record(i) for i in range(100)])
  args = _args(src, tmp_path / "out", "--processor", str(proc_dir), "--eval", "1",
               data=str(tmp_path / "d.jsonl"))
  limit = 4 << 20
  proc = subprocess.run(
      [sys.executable, "-m", "tools.convert", *args], cwd=ROOT, env=ENV, capture_output=True,
      text=True, timeout=120,
      preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
  _one_line_error(proc.returncode, proc.stderr, "File too large", "train.array_record")
  done = int(proc.stderr.strip().splitlines()[-1].split("(record ")[1].split(" of ")[0])
  assert done < 90, proc.stderr  # soon after the limit, not after every record
  assert _leftovers(tmp_path, {"proc", "d.jsonl"}) == []


def test_too_little_free_space_is_refused_before_converting(src, tmp_path, capsys, monkeypatch):
  free = shutil.disk_usage(tmp_path).free
  monkeypatch.setattr(conversion, "estimate_bytes", lambda records, proc: free * 2)
  rc, err, _ = _main(_args(src, tmp_path / "out"), capsys)
  _one_line_error(rc, err, "GB are free")
  assert "converting:" not in err and _leftovers(tmp_path) == []


@pytest.mark.parametrize("sig,early", [(signal.SIGTERM, False), (signal.SIGINT, False),
                                       (signal.SIGTERM, True)])
def test_an_interrupt_is_one_line_and_leaves_nothing(src, tmp_path, sig, early):
  """SIGTERM to the converter, or Ctrl-C (SIGINT to its process group, workers included), while
  it converts or (early) while it starts: one line, exit 128 + the signal, no worker tracebacks,
  nothing written."""
  proc = _spawn(_args(src, tmp_path / "out", data="big.jsonl", workers="2"),
                start_new_session=True)
  if early:  # its imports: an exception raised in a garbage-collection callback is only printed
    _wait_for(lambda: any(tmp_path.glob(f".out{output.PARTIAL}*")), proc)
  else:
    _wait_for(lambda: any(tmp_path.glob(f".out{output.PARTIAL}*/*.array_record.tmp")), proc)
    time.sleep(0.3)  # records on their way from the workers
  if sig == signal.SIGINT:
    os.killpg(proc.pid, sig)
  else:
    proc.send_signal(sig)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 128 + sig, err
  assert "Traceback" not in err and "Error" not in err, err
  shown = "Ctrl-C" if sig == signal.SIGINT else sig.name  # as every tool names them
  assert err.strip().splitlines()[-1].endswith(f"tools.convert: interrupted ({shown}); nothing "
                                               f"was written to {tmp_path / 'out'}.")
  assert _leftovers(tmp_path) == []


def test_an_interrupt_once_the_conversion_is_in_place_says_it_is_whole(src, tmp_path, capsys,
                                                                        monkeypatch):
  """Ctrl-C as the finished conversion's launch line is made, --out already in place: exit 130
  with a line that says the conversion is whole (not that nothing was written); it stays."""
  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt
  monkeypatch.setattr(convert, "launch_flags", interrupted)
  assert convert.main(_args(src, tmp_path / "out")) == 130
  assert capsys.readouterr().err.strip().splitlines()[-1] == (
      f"tools.convert: interrupted (Ctrl-C); {tmp_path / 'out'} was complete before it came: the "
      "conversion is whole, its summary cut short.")
  assert (tmp_path / "out" / "conversations.json").is_file()
  assert _leftovers(tmp_path) == ["out"]


@pytest.mark.parametrize("context,sig,record", [
    ("conversion._caught_signals()", signal.SIGINT, "caught"),
    ("output.interrupts_as_exceptions()", signal.SIGTERM, "output._PENDING"),
    ("output.interrupts_as_exceptions()", signal.SIGINT, "output._PENDING")])
def test_a_signal_inside_a_garbage_collection_callback_is_recorded_without_a_traceback(
    context, sig, record):
  """A signal handler's exception cannot leave a garbage-collection callback (Python hands it to
  `sys.unraisablehook`, which prints 'Exception ignored' and a traceback): the signal is recorded
  for the loop to raise again (output's block raises it as it ends), and nothing is printed. Run in a child, where the hook is Python's
  own."""
  script = textwrap.dedent(f"""
      import gc, os, signal
      from mimo_jax import output
      from mimo_jax.data import conversion

      def callback(phase, info):
        if phase == "start":
          os.kill(os.getpid(), {int(sig)})
          for _ in range(1000):  # the handler runs between bytecodes
            pass
      try:
        with {context} as caught:
          gc.callbacks.append(callback)
          try:
            gc.collect()
          finally:
            gc.callbacks.remove(callback)
          print(list({record}))
      except KeyboardInterrupt as e:  # output's block raises it again as it ends
        print("raised", e.signum)
  """)
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=120, check=False, cwd=ROOT, env=ENV)
  assert proc.returncode == 0, proc.stderr
  again = [f"raised {int(sig)}"] if context.startswith("output") else []
  assert proc.stdout.strip().splitlines() == [f"[{int(sig)}]", *again]
  assert proc.stderr == ""


def test_a_rerun_after_a_kill_converts(src, tmp_path, capsys):
  proc = _spawn(_args(src, tmp_path / "out", data="big.jsonl"))
  _wait_for(lambda: any(tmp_path.rglob("*.array_record.tmp")), proc)
  proc.kill()
  proc.communicate()
  assert _leftovers(tmp_path) != ["out"]  # what it was writing stays behind
  rc, err, _ = _main(_args(src, tmp_path / "out"), capsys)
  assert rc == 0, err
  assert _leftovers(tmp_path) == ["out"] and sum(_counts(tmp_path / "out").values()) == 30


def _children(pid: int) -> list[int]:
  """The processes whose parent is `pid` (Linux's /proc)."""
  out = []
  for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
    try:
      fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
      continue
    if int(fields[1]) == pid:
      out.append(int(stat.parent.name))
  return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers end with the parent "
                    "on Linux (prctl)")
def _cpu_s(pid: int) -> float:
  """CPU seconds process `pid` has used (0 once it is gone)."""
  try:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
  except OSError:
    return 0.0
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_workers_end_when_their_converter_is_killed(tmp_path):
  # kill -9 leaves the pool no time to end its workers: they end with it, not when the records
  # in hand are done (a chunk of 16 records of 24 large images: tens of seconds).
  (tmp_path / "images").mkdir()
  noise = np.random.default_rng(0).integers(0, 256, (3000, 3000, 3), dtype=np.uint8)
  Image.fromarray(noise).save(tmp_path / "images" / "noise.png", compress_level=1)
  records = [dict(_record(i, text="<image>\n" * 23 + "What is it?"), image=["noise.png"] * 24)
             for i in range(64)]
  _write(tmp_path / "heavy.jsonl", records)
  proc = _spawn(_args(tmp_path, tmp_path / "out", data="heavy.jsonl", workers="2"))
  # Both workers past their imports (a few CPU seconds) and into their records.
  _wait_for(lambda: sum(_cpu_s(w) > 6 for w in _children(proc.pid)) >= 2, proc, timeout=120)
  workers = _children(proc.pid)
  proc.kill()
  proc.wait()  # not communicate(): the workers hold its pipes open while they live
  deadline = time.monotonic() + 6  # a loaded machine takes a while to reap them
  try:
    while any(pathlib.Path(f"/proc/{w}").exists() for w in workers):
      assert time.monotonic() < deadline, f"workers {workers} outlived their converter"
      time.sleep(0.05)
  finally:
    for w in workers:
      with contextlib.suppress(OSError):
        os.kill(w, signal.SIGKILL)
    proc.communicate()


# Split sizes.

@pytest.mark.parametrize("n", ["-1", "0", "30", "31"])
def test_an_eval_size_that_leaves_no_split_is_refused(src, tmp_path, capsys, n):
  rc, err, _ = _main(_args(src, tmp_path / "out", "--eval", n), capsys)
  _one_line_error(rc, err, f"--eval {n}")
  assert _leftovers(tmp_path) == []


def test_the_default_eval_split_is_not_empty(src, tmp_path, capsys):
  rc, err, _ = _main(_args(src, tmp_path / "out"), capsys)
  assert rc == 0, err
  assert _counts(tmp_path / "out") == {"train": 27, "eval": 3}  # a tenth of 30
  assert [llava_json.default_eval(n) for n in (1, 30, 200, 5000, 10 ** 6)] == [1, 3, 10, 50,
                                                                                   1000]


def test_records_of_one_id_stay_on_one_side(src, tmp_path, capsys):
  ids = [f"id{k % 4}" for k in range(10)] + [f"solo{k}" for k in range(10)]
  _write(tmp_path / "d.jsonl", [_record(i, image=None, text=f"question of {rid}", rid=rid)
                                for i, rid in enumerate(ids)])
  rc, err, _ = _main(_args(src, tmp_path / "out", "--eval", "6", data=tmp_path / "d.jsonl"),
                     capsys)
  assert rc == 0, err
  assert "4 ids are shared by several records" in err
  tok = ChatTokenizer.open(TOKENIZER)
  from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
  seen = {}
  for split in conversations.SPLITS:
    path = tmp_path / "out" / f"{split}.array_record"
    reader = array_record_module.ArrayRecordReader(str(path))
    for i in range(reader.num_records()):
      text = tok.tokenizer.decode(conversations.decode(reader.read([i])[0], str(path), i)
                                  ["tokens"].tolist())
      seen.setdefault(re.search(r"question of (id\d|solo\d)", text).group(1), set()).add(split)
  assert len(seen) == 14 and all(len(sides) == 1 for sides in seen.values()), seen
  assert sum(ids.count(r) for r, sides in seen.items() if "eval" in sides) >= 6


# Bad records.

@pytest.fixture(scope="module")
def bad(src, tmp_path_factory):
  """Records each bad in one way, with the reason they are skipped for; a word-level tokenizer
  without an unknown token (digits') for the word it cannot encode."""
  root = tmp_path_factory.mktemp("bad")
  digits.write_tokenizer(root / "tok")
  (root / "images").mkdir()
  for name, side in (("small", 4), ("warn", 50), ("bomb", 100)):
    Image.fromarray(np.full((side, side), 9, np.uint8), mode="L").save(root / "images" /
                                                                        f"{name}.png")

  def rec(i, text="<img> seven", image="small.png", **kw):
    r = {"id": f"b{i}", "image": image,
         "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "seven"}]}
    r.update(kw)
    return r
  cases = {"image too large": [rec(0, image="warn.png"), rec(1, image="bomb.png")],
           "bad image field": [rec(2, image=5)],
           "bad conversation": [rec(3, conversations=["<img> seven", "seven"]),
                                rec(4, conversations=[{"from": "human", "value": 7},
                                                      {"from": "gpt", "value": "seven"}])],
           "untokenizable": [rec(5, text="<img> zebra")],
           "bad id field": [rec(6, id=float("nan")), rec(7, id={"b": 7}), rec(8, id=None)]}
  good = [rec(10 + k) for k in range(6)]
  for reason, records in cases.items():
    _write(root / f"{reason.replace(' ', '_')}.jsonl", records + good)
  _write(root / "all.jsonl", good + [r for rs in cases.values() for r in rs])
  return root, {k: len(v) for k, v in cases.items()}


def _bad_args(root, out, data, *extra):
  return ["--json", str(root / data), "--images", str(root / "images"), "--tokenizer",
          str(root / "tok"), "--image_token", "<img>", "--out", str(out), "--workers", "1",
          "--eval", "1", "--max_skipped_fraction", "1", *extra]


def test_bad_records_are_skipped_with_their_reasons(bad, tmp_path, capsys, monkeypatch):
  root, expected = bad
  monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)  # warn.png warns, bomb.png is refused
  rc, err, _ = _main(_bad_args(root, tmp_path / "out", "all.jsonl", "--eval", "2"), capsys)
  assert rc == 0, err
  assert "Traceback" not in err
  assert conversations.manifest(str(tmp_path / "out"))["skipped"] == expected
  assert sum(_counts(tmp_path / "out").values()) == 6
  # A bomb said as tools.eval and tools.generate say it, with the fix.
  assert re.search(r"image \S*bomb\.png is refused as a possible decompression bomb \(.*\); give "
                   r"a smaller image\.", err), err


def test_skipping_more_than_max_skipped_fraction_fails_writing_nothing(bad, tmp_path, capsys,
                                                                       monkeypatch):
  """9 of 15 records bad: past the default 5% the conversion fails naming the reasons and first
  records, leaving nothing (not even the folders above --out it made); allowed, it ends with that
  summary and the file that lists every skipped record."""
  root, expected = bad
  monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)
  args = _bad_args(root, tmp_path / "out", "all.jsonl", "--eval", "2")
  at = args.index("--max_skipped_fraction")
  del args[at:at + 2]  # the default limit
  deep = str(tmp_path / "made" / "for" / "it")  # folders the failed conversion made go too
  rc, err, _ = _main([deep if a == str(tmp_path / "out") else a for a in args], capsys)
  summary = ("9 of 15 records (60.0%) were skipped: bad id field 3 (record 12, record 13, "
             "record 14), image too large 2 ('b0', 'b1'), bad conversation 2 ('b3', 'b4'), bad "
             "image field 1 ('b2'), untokenizable 1 ('b5')")
  _one_line_error(rc, err, summary, "more than --max_skipped_fraction 0.05 allows")
  assert _leftovers(tmp_path) == []
  rc, err, _ = _main(args + ["--max_skipped_fraction", "0.7"], capsys)
  assert rc == 0, err
  listed = tmp_path / "out" / conversion_files.SKIPPED
  assert f"tools.convert: warning: {summary}; each with its error in {listed} " in err, err
  rows = [json.loads(line) for line in listed.read_text().splitlines()]
  assert [r["record"] for r in rows] == list(range(6, 15))
  assert {r["reason"]: sum(x["reason"] == r["reason"] for x in rows) for r in rows} == expected
  assert rows[0]["id"] == "b0" and rows[-1]["id"] is None and "(id 'b0')" in rows[0]["error"]
  # 1 of 21 (4.8%) under the default: converted, with the summary.
  good = json.loads((root / "all.jsonl").read_text().splitlines()[0])
  _write(tmp_path / "few.jsonl", [dict(good, id=f"g{k}") for k in range(20)]
         + [dict(good, id="odd", image=5)])
  instead = {str(root / "all.jsonl"): str(tmp_path / "few.jsonl"),
             str(tmp_path / "out"): str(tmp_path / "few")}
  rc, err, _ = _main([instead.get(a, a) for a in args], capsys)
  assert rc == 0, err
  assert ("tools.convert: warning: 1 of 21 records (4.8%) was skipped: bad image field 1 ('odd'); "
          "each with its error in ") in err, err


def test_eval_records_that_are_skipped_are_named_and_a_fraction_of_1_sets_no_limit(bad, tmp_path,
                                                                                  capsys):
  """Eval is drawn before records are skipped (and not redrawn): the end says how many of the
  drawn records eval holds. --max_skipped_fraction 1 (no limit) is not said to fail anything."""
  root, _ = bad  # all.jsonl: 6 good records, then the bad ones
  rc, err, _ = _main(_bad_args(root, tmp_path / "out", "all.jsonl", "--eval", "8"), capsys)
  assert rc == 0, err
  held = _counts(tmp_path / "out")["eval"]
  assert 0 < held < 8, held  # seed 0 draws bad records too
  assert (f"tools.convert: warning: eval holds {held} of the 8 records --eval 8 drew: {8 - held} of "
          f"them {'was' if 8 - held == 1 else 'were'} skipped (a skipped record is not replaced; "
          "a larger --eval holds more).") in err.splitlines(), err
  assert "fails a conversion" not in err and "--max_skipped_fraction" not in err, err
  # Eval whole: no such line; a limit below 1 is named.
  rc, err, _ = _main(_bad_args(root, tmp_path / "all", "bad_image_field.jsonl",
                               "--max_skipped_fraction", "0.5"), capsys)
  assert rc == 0, err
  assert "eval holds" not in err and "(--max_skipped_fraction 0.5 fails a conversion" in err, err
  assert _counts(tmp_path / "all")["eval"] == 1


@pytest.mark.parametrize("flag,value,said", [("--max_skipped_fraction", "abc", "not a number"),
                                             ("--workers", "two", "not an integer"),
                                             ("--on_error", "ignore", "invalid choice")])
def test_a_flag_argparse_refuses_is_one_line(src, tmp_path, capsys, flag, value, said):
  rc, err, _ = _main(_args(src, tmp_path / "out") + [flag, value], capsys)
  assert rc == 2 and len(err.strip().splitlines()) == 1, err
  assert err.startswith("tools.convert: error: ") and said in err and "usage:" not in err, err
  if said.startswith("not"):
    assert err.strip() == f"tools.convert: error: {flag} {value}: {said}.", err
  assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("reason", ["image too large", "bad image field", "bad conversation",
                                    "untokenizable", "bad id field"])
def test_a_bad_record_under_fail_is_one_line(bad, tmp_path, capsys, monkeypatch, reason):
  root, _ = bad
  monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)
  data = f"{reason.replace(' ', '_')}.jsonl"
  rc, err, _ = _main(_bad_args(root, tmp_path / "out", data, "--on_error", "fail"), capsys)
  _one_line_error(rc, err, "record 0 (id ", "--on_error skip converts the rest",
                  "\"id\" is NaN, not a string or an integer" if reason == "bad id field" else "")
  assert _leftovers(tmp_path) == []


def test_image_paths_out_of_images_are_refused_unless_allowed(src, tmp_path, capsys):
  images = tmp_path / "images"
  images.mkdir()
  shutil.copy(src / "images" / "tiny.png", images / "in.png")
  shutil.copy(src / "images" / "tiny.png", tmp_path / "secret.png")
  (images / "link.png").symlink_to(tmp_path / "secret.png")
  (images / "sub").mkdir()
  records = [_record(0, image="../secret.png"), _record(1, image=str(tmp_path / "secret.png")),
             _record(2, image="link.png"), _record(3, image="sub/../in.png")]
  records += [_record(10 + k, image="in.png") for k in range(4)]
  _write(tmp_path / "d.jsonl", records)
  args = ["--json", str(tmp_path / "d.jsonl"), "--images", str(images), "--tokenizer",
          str(TOKENIZER), "--processor", str(PROCESSOR), "--workers", "1", "--eval", "2",
          "--max_skipped_fraction", "1"]
  rc, err, _ = _main(args + ["--out", str(tmp_path / "strict")], capsys)
  assert rc == 0, err
  assert conversations.manifest(str(tmp_path / "strict"))["skipped"] == {"outside --images": 3}
  assert err.count("leads out of --images") == 3
  rc, err, _ = _main(args + ["--out", str(tmp_path / "loose"), "--allow_outside_images"], capsys)
  assert rc == 0, err
  assert conversations.manifest(str(tmp_path / "loose"))["skipped"] == {}


def test_without_images_paths_are_read_from_the_json_folder(src, tmp_path, capsys):
  """--images is optional: records of text alone need none, and image paths default to the
  JSON's folder (as tools.eval's); an image missing there names the default and --images."""
  shutil.copy(src / "images" / "tiny.png", tmp_path / "tiny.png")
  _write(tmp_path / "text.jsonl", [_record(i, image=None) for i in range(4)])
  _write(tmp_path / "near.jsonl", [_record(i, image="tiny.png") for i in range(4)])
  _write(tmp_path / "far.jsonl", [_record(i, image="portrait.png") for i in range(4)])
  args = lambda data, out: ["--json", str(tmp_path / data), "--tokenizer", str(TOKENIZER),
                            "--processor", str(PROCESSOR), "--out", str(tmp_path / out),
                            "--workers", "1", "--eval", "1"]
  for data, images in (("text.jsonl", 0), ("near.jsonl", 4)):
    rc, err, _ = _main(args(data, data + ".out"), capsys)
    assert rc == 0, err
    assert conversations.manifest(str(tmp_path / (data + ".out")))["images"] == images
  rc, err, _ = _main(args("far.jsonl", "far") + ["--on_error", "fail"], capsys)
  _one_line_error(rc, err, f"image {tmp_path / 'portrait.png'} not found",
                  f"No --images was given: image paths were read relative to --json's folder "
                  f"{tmp_path}; give --images DIR")
  assert not (tmp_path / "far").exists()


# Bad flags and files: one line, exit 2, nothing written.

def test_bad_flags_and_files_are_one_line_and_write_nothing(src, tmp_path, capsys):
  plain = tmp_path / "plain"  # a tokenizer without a chat template
  plain.mkdir()
  shutil.copy(TOKENIZER / "tokenizer.json", plain)
  config = json.loads((TOKENIZER / "tokenizer_config.json").read_text())
  del config["chat_template"]
  (plain / "tokenizer_config.json").write_text(json.dumps(config))
  (tmp_path / "latin1.json").write_bytes('[{"id": "caf\u00e9"}]'.encode("latin-1"))
  (tmp_path / "file").write_text("keep")
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "notes.txt").write_text("keep")
  out = tmp_path / "out"
  cases = [
      (["--tokenizer", str(plain), "--processor", str(PROCESSOR)], "no chat_template"),
      (["--image_token", "<picture>"], "--image_token '<picture>'"),
      (["--image_token", "Hello"], "is not one token"),
      (["--json", str(tmp_path / "latin1.json")], "not UTF-8 (byte 0xe9"),
      (["--out", str(tmp_path / "file")], "is a file"),
      (["--out", str(tmp_path / "full")], "is not empty (notes.txt)"),
      (["--out", "/proc/mimo_convert_out"], "--out='/proc/mimo_convert_out'"),
  ]
  before = sorted(str(p) for p in tmp_path.rglob("*"))
  for extra, words in cases:
    rc, err, _ = _main(_args(src, out) + extra, capsys)
    _one_line_error(rc, err, words)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before, extra
  assert (tmp_path / "file").read_text() == "keep"
  # A missing input is the only line: no note on the tower's tokens before it.
  for flag, path in (("--json", tmp_path / "none.jsonl"), ("--tokenizer", tmp_path / "none")):
    rc, err, _ = _main(_args(src, out) + [flag, str(path)], capsys)
    assert rc == 2 and err.strip().splitlines() == [
        f"tools.convert: error: {flag} {path}: not found "
        f"({'a file' if flag == '--json' else 'a directory'} is needed)."], err
  # So is a directory given for the JSON, and a flag out of its range.
  rc, err, _ = _main(_args(src, out) + ["--json", str(tmp_path / "full")], capsys)
  assert rc == 2 and err.strip().splitlines() == [
      f"tools.convert: error: --json {tmp_path / 'full'}: a directory (a file is needed)."], err
  rc, err, _ = _main(_args(src, out) + ["--seed", "-1"], capsys)
  assert rc == 2 and len(err.strip().splitlines()) == 1 and "--seed at least 0" in err, err
  assert sorted(str(p) for p in tmp_path.rglob("*")) == before


# Paths that work from any directory, and the launch line.

def test_manifest_paths_work_from_any_directory(src, tmp_path, capsys, monkeypatch):
  work = tmp_path / "work"
  shutil.copytree(TOKENIZER, work / "tok")
  shutil.copytree(PROCESSOR, work / "proc")
  shutil.copy(src / "a.jsonl", work / "a.jsonl")
  monkeypatch.chdir(work)
  rc, err, _ = _main(["--json", "a.jsonl", "--images", str(src / "images"), "--tokenizer", "tok",
                      "--processor", "proc", "--out", "../out", "--workers", "1"], capsys)
  assert rc == 0, err
  m = conversations.manifest("../out")
  for key, want in (("tokenizer", "tok"), ("processor", "proc"), ("source", "a.jsonl")):
    assert m[key] == str(work / want)
  monkeypatch.chdir(tmp_path)
  old = tmp_path / "old"  # a conversion that stored paths relative to where it ran
  old.mkdir()
  assert conversations.source_path(str(old), "work/tok") == str(work / "tok")
  (old / "tok").mkdir()  # a path inside the directory goes first
  assert conversations.source_path(str(old), "tok") == str(old / "tok")


def test_the_launch_line_is_a_valid_run_whose_rows_hold_every_sample(src, tmp_path, capsys):
  """The printed line, on the tiny config with its own other values, is a valid run whose rows
  hold every sample of the conversion; its vocab_size is config.json's beside the tokenizer
  (more ids than the tokenizer's)."""
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  from mimo_jax.data import capacity, loader  # pylint: disable=import-outside-toplevel
  tok = tmp_path / "tok"
  shutil.copytree(TOKENIZER, tok)
  vocab = Tokenizer.from_file(str(tok / "tokenizer.json")).get_vocab_size() + 64
  (tok / "config.json").write_text(json.dumps({"model_type": "llava",
                                               "text_config": {"vocab_size": vocab}}))
  cfg = tiny_config("", vision=(0, 1, 1), language=(0, 1, 1))
  cfg.model.vision.image_size = 20  # the processor's
  tokens = cfg.model.vision.tokens_per_image  # what an image takes in the tiny model's rows
  out = tmp_path / "a conversion"  # a space the shell must be told of
  rc, err, printed = _main(_args(src, out, "--image_tokens", str(tokens), "--tokenizer",
                                 str(tok), "--global_batch", "4"), capsys)
  assert rc == 0, err
  line = shlex.split(printed.strip().splitlines()[-1])
  assert line[:4] == ["python", "-m", "mimo_jax.launch", "--config=MODEL_CONFIG"]
  assert "MODEL_CONFIG: the model's config file" in printed
  flags = dict(f.removeprefix("--config.").split("=", 1) for f in line[4:])
  assert flags["data.dir"] == str(out) and flags["eval.samples"] == "3"
  assert flags["data.seq_len"] == str(conversations.manifest(flags["data.dir"])["longest"])
  assert flags["data.global_batch"] == "4"
  assert flags["model.language.vocab_size"] == str(vocab)
  for key, value in flags.items():
    section, field = key.rsplit(".", 1)
    parent = cfg
    for name in section.split("."):
      parent = getattr(parent, name)
    setattr(parent, field, type(getattr(parent, field))(value))
  validation.validate(cfg, 8)
  validation_data.validate_data(cfg)
  # Every train sample fits the line's rows, as the run checks before compiling (an epoch of
  # steps).
  paths = conversations.paths(cfg)
  steps = -(-len(loader.open_shard(paths["train"], "conversations")) // cfg.data.global_batch)
  assert capacity.check_capacity(cfg, paths["train"], 1, 0, steps)
