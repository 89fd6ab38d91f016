"""A checkpoints folder on disk: a workdir's (`directory`), its committed steps (orbax writes
`commit_success.txt` last), a step folder moved aside, the digest a step's metadata holds of
itself, where a LoRA run's frozen weights are held (`Base`, `base_folder`), and what a run says
of the folders moved aside (`why_aside`), of a step it cannot restore (`damaged`), of a file or
folder it may not read (`PermissionDenied`, `unreadable`) and of an old step it could not remove
(`removal_warning`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pwd

from mimo_jax import workdir as workdir_lib
from mimo_jax.config import ConfigError


class PermissionDenied(ConfigError):
  """A checkpoint's file or folder that this user may not read (its mode, or another user's
  folder): a sign of its permissions, not of damage, so its step is neither moved aside nor
  passed over for an older one. The run or tool stops, naming it and the fix. `base_of`: the
  step whose frozen base weights it holds (`Base`), which a run may read elsewhere instead."""

  def __init__(self, path: str, base_of: int | None = None):
    try:
      uid = os.stat(path).st_uid
    except OSError:
      uid = None
    fix = "fix its permissions"
    if uid is not None and uid != os.geteuid():
      try:
        owner = pwd.getpwuid(uid).pw_name
      except KeyError:
        owner = f"uid {uid}"
      fix += f", or run as the user that owns it ({owner})"
    kind, of = "folder" if os.path.isdir(path) else "file", ""
    if base_of is not None:
      of = f" (the frozen base of step {base_of})"
      fix += (", or name another copy of that base with --config.checkpoint.base=DIR (a workdir "
              "or its checkpoints folder)")
    super().__init__(f"cannot read the checkpoint {kind} {path}{of}: permission denied; {fix}, "
                     "and run the same command again (nothing was moved aside or deleted).")
    self.path, self.base_of = path, base_of


def unreadable(folder: str) -> str | None:
  """The first file or folder in `folder` (a step's) that this user may not read (listing or
  opening it is denied), or None: what a failed read of the step is said to be instead of
  damage."""
  denied = []

  def note(e: OSError) -> None:
    if isinstance(e, PermissionError) and not denied:
      denied.append(workdir_lib.error_file(e) or folder)
  for root, _, files in os.walk(folder, onerror=note):
    for name in files:
      try:
        with open(os.path.join(root, name), "rb"):
          pass
      except OSError as e:
        note(e)
    if denied:
      break
  return denied[0] if denied else None


def directory(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "checkpoints")


def complete_steps(path: str) -> list[int]:
  """Steps whose save finished: orbax writes `commit_success.txt` last. A step folder without it
  (a save cut short on a file system without atomic renames) is never restored. A folder this
  user may not look into raises PermissionDenied: whether its step is complete is unknown, and
  taking it for an uncommitted one would move it aside and resume from an older step."""
  if not os.path.isdir(path):
    return []
  try:
    names = sorted((d for d in os.listdir(path) if d.isdigit()), key=int)
  except PermissionError:
    raise PermissionDenied(path) from None
  steps = []
  for d in names:
    try:
      os.stat(os.path.join(path, d, "commit_success.txt"))
    except PermissionError:  # the step's folder may not be entered (or the checkpoints folder)
      folder = os.path.join(path, d)
      raise PermissionDenied(folder if os.path.exists(folder) else path) from None
    except OSError:  # none there (or `d` is a file): not committed
      continue
    steps.append(int(d))
  return steps


def move_aside(path: str, step: int, why: str) -> str:
  """Renames `path/step` to `path/step.why` (or `.why-2`, ...); returns the new name."""
  n, target = 1, os.path.join(path, f"{step}.{why}")
  while os.path.exists(target):
    n += 1
    target = os.path.join(path, f"{step}.{why}-{n}")
  os.rename(os.path.join(path, str(step)), target)
  return target


def digest(meta: dict) -> str:
  """The digest a step's metadata holds of itself (`meta["digest"]`): sha256 of the rest."""
  body = {k: v for k, v in meta.items() if k != "digest"}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def meta_file(path: str, step: int) -> str:
  """The file holding `step`'s metadata in checkpoints folder `path` (orbax's JSON item `meta`)."""
  return os.path.join(path, str(step), "meta", "metadata")


def digest_failure(meta) -> str | None:
  """What is wrong with the metadata of a step against its digest ("does not match its digest"),
  or None. Every step this code saves holds a digest (since its first checkpoints), so metadata
  without one is damaged (or edited) as much as metadata whose digest differs."""
  if not isinstance(meta, dict) or "digest" not in meta:
    return "holds no digest"
  return None if meta["digest"] == digest(meta) else "does not match its digest"


@dataclasses.dataclass(frozen=True)
class Base:
  """Where the frozen weights of a run with LoRA adapters are held: a step of a checkpoint
  folder (`path` relative to the folder of the checkpoints naming it: "." for their own) that
  holds every parameter (an import's step 0, or the step 0 a run writes of the weights it starts
  from), and the fingerprints that step holds of them: module -> `params/<path>` -> fingerprint.
  The run's later steps hold the trained parameters and name this one (`meta["base"]`)."""
  path: str
  step: int
  fingerprints: dict

  def as_meta(self) -> dict:
    return {"path": self.path, "step": self.step, "fingerprints": self.fingerprints}


def base_folder(own: str, recorded: str, moved: str = "") -> str:
  """The folder a base lives in: `moved` (checkpoint.base: a workdir or its checkpoints folder)
  where given, else the one recorded, relative to `own` (the naming checkpoints' folder)."""
  if moved:
    return directory(moved) if os.path.isdir(os.path.join(moved, "checkpoints")) else \
        os.path.abspath(moved)
  return os.path.normpath(os.path.join(own, recorded))


def why_aside(moved: str) -> str:
  """Why checkpoint.py moved a step folder aside, from the suffix it gave it (`30.replaced-2`)."""
  why = os.path.basename(moved).split(".", 1)[-1].split("-")[0]
  return {"uncommitted": "its save never completed: not a step",
          "replaced": "newer than checkpoint.restore_step: this run writes its own"}.get(
              why, "not a step of this run")


def damaged(path: str, step: int, what: str, source: str | None = None) -> str:
  """What a run says of `step` of checkpoints folder `path`, which it cannot restore (`what`:
  why), and how to go on: from an older step, if there is one, or afresh (`source`: the config
  field naming the folder, for a run that starts from it, which names another step instead)."""
  older = [s for s in complete_steps(path) if s < step]
  # An older step may be damaged too: the tool that reads every step says which are intact
  # (each failed resume would move one more step aside).
  checked = (f" (`python -m tools.ckpt check {os.path.dirname(path)}` says first whether "
             "it is intact)")
  if older and older[-1] > 0:
    fix = (f"resume from step {older[-1]} with --config.checkpoint.restore_step={older[-1]}"
           f"{checked}, or start in a new run.workdir")
  elif older:  # restore_step=0 means the newest: step 0 is resumed by moving this one away
    fix = (f"move {path}/{step} away to resume from step 0{checked}, or start in a new "
           "run.workdir")
  else:
    fix = f"move {path}/{step} away to start from scratch, or start in a new run.workdir"
  if source is not None:  # a run a new one starts from (init_from)
    fix = (f"choose another step with --config.{source}={os.path.dirname(path)}:N"
           f"{f' (N = {older[-1]})' if older else ''}")
  return f"{path}: step {step} {what}. Its files are damaged or incomplete: {fix}."


def removal_warning(path: str, writing: int | None, e: OSError, keep: int) -> str | None:
  """The warning for `e`, raised by the save of step `writing` into checkpoints folder `path`,
  where it is a failure to remove an old step, else None: orbax removes the steps past
  checkpoint.keep once the new step is committed, so a failure with the new step committed is
  one (a failure to write a step leaves it uncommitted). The run goes on, the old step's folder
  left on disk."""
  if writing is None or writing not in complete_steps(path):
    return None
  where = workdir_lib.error_file(e)
  inside = os.path.relpath(where, path) if where and os.path.isabs(where) else ".."
  folder = (os.path.join(path, inside.split(os.sep)[0])
            if not inside.startswith("..") else f"an old step folder in {path}")
  why = os.strerror(e.errno) if e.errno else str(e)
  return (f"warning: could not remove {folder} (checkpoint.keep={keep} keeps the newest {keep} "
          f"steps): {f'{where}: ' if where else ''}{why}; the run goes on; delete that folder by "
          "hand.")
