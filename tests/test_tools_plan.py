"""The split planner, tools/plan.py: its candidate layouts and their predicted steps, the bound on
any split, the costs read from a profile, the work counted from metadata, layouts left out for
memory, and its checks of the config it plans (tests/test_tools_bench.py runs it end to end on a
profile of tools/bench.py)."""

import json

import pytest

from tests.configs import tiny_vlm
from tools import plan


def test_planner_candidates_are_valid_layouts_and_predictions_follow_the_model(tmp_path):
  sets = ["data.dir=" + str(tmp_path)]
  cands = plan.candidates("tests/configs/tiny_vlm.py:encoder_heavy", sets, 4, max_tp=1)
  layouts = {c["layout"] for c in cands}
  assert "vision=0/4/1,language=0/4/1" in layouts and "vision=0/2/1,language=2/2/1" in layouts
  assert all(c["vision_gpus"] + c["language_gpus"] == 4 for c in cands
             if c["kind"] == "non-colocated")
  assert plan.profile_layouts(4) == ["vision=0/1/1,language=0/1/1", "vision=0/2/1,language=0/2/1",
                                     "vision=0/4/1,language=0/4/1"]
  coloc, split = {"kind": "colocated"}, {"kind": "non-colocated"}
  assert plan.predict(coloc, 2.0, 6.0, 4, 0.01) == pytest.approx(8.0)
  # The encoder runs ahead: its time, unless the language model's plus one encoder microbatch is
  # longer.
  assert plan.predict(split, 2.0, 6.0, 4, 0.01) == pytest.approx(6.0 + 2.0 / 4 + 0.01)
  assert plan.predict(split, 6.0, 2.0, 4, 0.01) == pytest.approx(6.0 + 0.01)


def test_split_bound_is_below_every_split_and_uses_each_modules_fewest_gpu_seconds():
  def cand(kind, gv, gl, tv, tl):
    c = {"kind": kind, "vision_gpus": gv, "language_gpus": gl, "t_vision": tv, "t_language": tl}
    c["predicted_s"] = plan.predict(c, tv, tl, 4, 0.0)
    return c
  # vision takes 1.8 GPU-seconds on 1 GPU, 2.0 on 2 and 2.4 on 3; language 1.5, 1.2 and 1.5.
  cands = [cand("colocated", 4, 4, 0.55, 0.35), cand("non-colocated", 1, 3, 1.8, 0.5),
           cand("non-colocated", 2, 2, 1.0, 0.6), cand("non-colocated", 3, 1, 0.8, 1.5)]
  got = plan.split_bound(cands, 4)
  assert got["vision"] == pytest.approx((1.8, 1)) and got["language"] == pytest.approx((1.2, 2))
  assert got["step_s"] == pytest.approx((1.8 + 1.2) / 4)
  assert all(got["step_s"] <= c["predicted_s"] for c in cands if c["kind"] == "non-colocated")
  assert plan.split_bound(cands[:1], 4) is None


def test_planner_costs_interpolate_in_dp_and_take_tp_as_dp(tmp_path):
  """Cost = busy * GPUs / work at each profiled (dp, tp); between profiled dps it is linear, beyond
  them the nearest; f_g is a colocated dp-only step over its modules' busy sum."""
  spec, sets = "tests/configs/tiny_vlm.py:encoder_heavy", [f"data.dir={tmp_path}"]
  rows = [{"layout": "vision=0/1/1,language=0/1/1", "step_s": 2.4, "busy_vision_s": 1.0,
           "busy_language_s": 2.0},
          {"layout": "vision=0/4/1,language=0/4/1", "step_s": 1.0, "busy_vision_s": 0.5,
           "busy_language_s": 0.75}]
  costs = plan.Costs(rows, spec, sets, lambda cfg: {"vision": 10.0, "language": 20.0})
  assert costs("vision", 1, 1) == (pytest.approx(0.1), "profiled")
  assert costs("vision", 4, 1) == (pytest.approx(0.2), "profiled")  # 0.5 s * 4 GPUs / 10
  assert costs("vision", 2, 1) == (pytest.approx(0.1 + 0.1 / 3), "interpolated")
  assert costs("language", 8, 1) == (pytest.approx(0.15), "from dp4")
  assert costs("language", 2, 2) == (pytest.approx(0.15), "as dp4")
  assert costs.factor(1) == pytest.approx(0.8) and costs.factor(4) == pytest.approx(0.8)
  assert costs.factor(2) == pytest.approx(0.8)
  with pytest.raises(SystemExit, match="no profile row has busy times"):
    plan.Costs([{"layout": rows[0]["layout"], "step_s": 1.0}], spec, sets,
               lambda cfg: {"vision": 1.0, "language": 1.0})


@pytest.mark.parametrize("layout", ["vision=0/1/1,language=0/1/1", "vision=0/2/1,language=2/2/1",
                                    "vision=0/4/1,language=0/4/1"])
def test_planner_work_from_metadata_matches_the_loader(tmp_path, layout):
  """The work the planner counts from metadata alone equals what the training loader (reading every
  record) sends to each module."""
  cfg = tiny_vlm.get_config("dynamic")
  cfg.data.dir, cfg.data.slot_buckets, cfg.data.pack_rows, cfg.data.row_buckets = (
      str(tmp_path), 4, 4, 4)
  cfg.model.vision.image_slots = 16
  from mimo_jax.config import set_layout  # pylint: disable=import-outside-toplevel
  from mimo_jax.data import loader  # pylint: disable=import-outside-toplevel
  set_layout(cfg, layout)
  path = loader.build_paths(cfg)["train"]
  got = plan.work(cfg, path, 3)
  ds = loader.train_dataset(cfg, path, cfg.topology.language.dp)
  slots = sum(int(ds[s].slots["vision"].sent.sum()) for s in range(3))
  rows = sum(int(ds[s].text.rows_sent.sum()) for s in range(3))
  g = cfg.topology.language.dp
  assert got["vision"] == pytest.approx(slots * g * ds[0].slots["vision"].owner_nt.shape[-1] / 3)
  assert got["language"] == pytest.approx(rows * g * cfg.data.seq_len / 3)
  assert got["vision"] > 0 and got["language"] > 0


def test_planner_leaves_out_layouts_that_cannot_fit():
  """Memory is a planner input: with the language model's state split over dp (FSDP), a budget
  that replicated layouts exceed still admits the dp-only ones, and every admitted layout's
  estimate is within it."""
  spec = "tests/configs/tiny_vlm.py:encoder_heavy"
  every = plan.candidates(spec, [], 4, max_tp=2, memory_gb=1e6)
  assert every and all(c["gib"] > 0 for c in every)
  budget = sorted(c["gib"] for c in every)[len(every) // 2]  # the median layout's need
  refused = []
  kept = plan.candidates(spec, [], 4, max_tp=2, memory_gb=budget, refused=refused)
  assert kept and refused and len(kept) + len(refused) == len(every)
  assert all(c["gib"] <= budget for c in kept) and all(c["gib"] > budget for c in refused)
  sharded = plan.candidates(spec, ["topology.language.shard=full", "topology.vision.shard=full"],
                            4, max_tp=2, memory_gb=budget)
  assert len(sharded) > len(kept)  # sharding the state lets more layouts fit


@pytest.mark.parametrize("config,sets,said", [
    ("configs/digits.py", ["--set", "data.global_batchh=3"],
     "plan: error: --set data.global_batchh=3: unknown config field 'global_batchh'; "),
    ("configs/av_digits.py", [], "plan: error: {p}'s config configs/av_digits.py has encoders "
     "vision, audio; tools.plan places one encoder (vision) and the language model, "),
])
def test_plan_checks_the_config_it_plans_before_comparing_profiles(config, sets, said, tmp_path,
                                                                   capsys):
  """A --set the config does not have, or a config with modules the planner does not place, is
  named before the profile is compared with the flags (a mismatch would be the wrong advice)."""
  p = tmp_path / "prof.json"
  p.write_text(json.dumps({"config": config, "set": [], "rows": [
      {"layout": "vision=0/1/1,language=0/1/1", "step_s": 1.0}]}))
  with pytest.raises(SystemExit) as raised:
    plan.main([f"--profile={p}", "--gpus=4", *sets])
  err = capsys.readouterr().err
  assert raised.value.code == 2 and len(err.strip().splitlines()) == 1, err
  assert err.startswith(said.format(p=p)), err


def test_a_budget_below_a_gib_is_said_in_mib(capsys):
  """`--memory_gb` of 0.002: every refusal and the error say MiB, not "0.0 GiB"."""
  with pytest.raises(SystemExit) as e:
    plan.main(["--config=configs/digits.py", "--gpus=4", "--layouts_only", "--memory_gb=0.002"])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("plan: error: no layout of 4 GPUs fits 2.0 MiB a GPU;"), err
  assert err[:-1] and all(line.startswith("does not fit: ") and line.endswith(" a GPU of 2.0 MiB")
                          and "0.0 GiB" not in line for line in err[:-1]), err
