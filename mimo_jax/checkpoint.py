"""orbax checkpoints: one item per module (params + optimizer state) and one `meta` item.

`meta` holds the step, the data position, the seeds, the config that wrote the checkpoint, a
fingerprint of every saved array (fingerprint.py, computed on the devices at save time) and a
digest of itself. A restore reads each module into abstract arrays carrying the *current*
topology's shardings, so a checkpoint written on one layout restores onto any other, and checks
every array against its fingerprint: a damaged step is refused, never trained on.

orbax writes a step into a temporary folder and renames it when complete (`commit_success.txt`
last). A step folder without that file is never a step: it is moved aside as `<step>.uncommitted`
so that it neither counts as the latest step nor blocks a new save of that step. Resuming from an
older step (`checkpoint.restore_step`) moves the newer steps aside as `<step>.replaced`, since the
run will write its own. Both are noted when a run opens the folder and done once its checks have
passed (`Checkpointer.tidy`): a run that stops with an error before training renames nothing. A
plain file named like a step is no step folder: the run refuses it (a save of that step would
fail on it), renaming nothing.

With several processes, a module whose mesh spans devices of every process is saved and restored as
it is: each process writes and reads its own shards (an FSDP language model is never gathered).
orbax refuses arrays that live on the devices of some processes only (a module whose mesh sits on
one host): those are first moved, through the bridge, to a layout over every process ("global"):
split on the first axis over every device where it divides evenly, else on one device of each
process; restore reverses the path onto the current topology (checkpoint_layout.py).

The folder's steps and the base a LoRA run's steps name are in checkpoint_steps.py, the
checks and conversions of a step's arrays in checkpoint_arrays.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import orbax.checkpoint as ocp

from mimo_jax import checkpoint_base
from mimo_jax import checkpoint_layout as layout
from mimo_jax import distributed, fingerprint, optim, run_paths, xla_errors
from mimo_jax.checkpoint_arrays import (as_saved, bfloat16_if_exact, fill, mismatches, regrouped,
                                        shape_differences, without)
from mimo_jax.checkpoint_config import CheckpointError, check_compatible, data_values
from mimo_jax.checkpoint_orbax import (batched_array_registry, collect, not_read_only_notice,
                                      quiet_failed_reads, read_failure,
                                      step_record_errors_dropped, step_record_note)
from mimo_jax.checkpoint_steps import (Base, PermissionDenied, base_folder, complete_steps, damaged,
                                      digest, digest_failure, meta_file, move_aside, unreadable)
from mimo_jax.config import Config
from mimo_jax.data import identity
from mimo_jax.state import ModuleState
from mimo_jax.trees import path_str

META = "meta"
name_base = checkpoint_base.name_base  # a LoRA run's base, named as it starts (train.py)


class Checkpointer:
  """Saves and restores training state under `<workdir>/checkpoints`."""

  def __init__(self, path: str, modules: list[str], keep: int = 3, async_save: bool = True,
               read_only: bool = False, host_gb: int | None = None, keep_steps: tuple = ()):
    """`host_gb`: at most this many GB of arrays copied off the devices and being written at a
    time by a save (orbax's defaults: no limit on the copies, 96 GB being written); a checkpointer
    with a limit saves only (`tools.hf import`'s step 0). Saves are uncompressed: trained float32
    weights and moments compress by a few percent, for CPU time in every save and restore
    (docs/benchmarks.md). `keep_steps`: steps never rotated away (a LoRA run's base, `Base`)."""
    self.path, self.modules = path, list(modules)
    self._failed = False  # a restore failed: its abandoned reads are collected on close
    self._set_aside = []  # step folders moved aside (`set_aside`)
    self._aside = []  # (step, why) of the folders to move aside once the checks passed (`tidy`)
    self._tidied = False
    # Made by this checkpointer (orbax's manager creates it): removed by `close` if still empty,
    # so a run that fails before its first save leaves no empty checkpoints folder behind.
    self._made = not read_only and distributed.is_main() and not os.path.lexists(path)
    if not read_only and os.path.isdir(path):  # (every process: each refuses a file alike)
      complete = set(complete_steps(path))  # first: a folder it may not read is refused
      names = sorted((d for d in os.listdir(path) if d.isdigit()), key=int)
      files = [d for d in names if not os.path.isdir(os.path.join(path, d))]
      if files:
        raise CheckpointError(
            f"{os.path.join(path, files[0])} is a file, not a step's folder (a save of step "
            f"{int(files[0])} would fail on it); move it out of {path}.")
      self._aside = [(int(d), "uncommitted") for d in names if int(d) not in complete]
    # With several processes orbax's background thread runs device collectives across processes;
    # alongside the training step's cross-process copies that can deadlock, so saves block there.
    # A read-only checkpointer never saves: no background thread.
    async_save = async_save and jax.process_count() == 1 and not read_only
    step_record_errors_dropped()  # orbax's ERROR for a damaged one: `checked_meta` notes it
    if read_only and not_read_only_notice not in logging.getLogger("absl").filters:
      # Before the options: their construction warns that a read-only manager is read-only.
      logging.getLogger("absl").addFilter(not_read_only_notice)
    kept = {}
    if keep and keep_steps and not read_only:
      policies = ocp.checkpoint_managers
      kept = {"preservation_policy": policies.AnyPreservationPolicy(
          [policies.LatestN(keep), policies.CustomSteps(list(keep_steps))])}
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if kept else keep or None, enable_async_checkpointing=async_save,
        create=not read_only, read_only=read_only, cleanup_tmp_directories=not read_only, **kept)
    self.host_batched = False  # whether a save copies `host_gb` at a time (else all at once)
    if host_gb is None:  # a restore reads by the saved structure, with placeholders: PyTree
      handlers = {n: ocp.PyTreeCheckpointHandler(save_concurrent_gb=96, restore_concurrent_gb=96,
                                                 use_compression=False)
                  for n in self.modules}
    else:  # the standard handler limits the bytes being written, not those copied to the host
      registry = batched_array_registry()
      self.host_batched = registry is not None
      handlers = {n: ocp.PyTreeCheckpointHandler(
          save_concurrent_gb=host_gb, save_device_host_concurrent_gb=host_gb,
          enable_pinned_host_transfer=False,  # peak 11.0-11.3 GiB importing 1.65B, pinned 12.1-12.5
          use_compression=False,  # also the 8B import's peak: 24.8 GiB, compressed 30.9-33.0
          **({"type_handler_registry": registry} if registry else {})) for n in self.modules}
    self.source = None  # the config field naming this run when a new run starts from it
    self.base: Base | None = None  # where saves leave the frozen weights (a LoRA run's)
    self.moved_base = ""  # checkpoint.base: where a base named by a step is now
    self.notes = []  # what a restore did beyond reading the step as saved, for the run's log
    self._data = {}  # the data fingerprint, computed once per run (data.identity.fingerprint)
    self._trees = {}  # step -> orbax's metadata of its items, read once (it opens every array)
    handlers[META] = ocp.JsonCheckpointHandler()
    # orbax lists the uncommitted folders as steps until `tidy` moves them: it warns that their
    # metadata is missing, which is why they are not steps.
    noted = tuple(os.path.join(path, str(step), "") for step, _ in self._aside)
    unsaid = lambda r: not ("Metadata file does not exist" in r.getMessage()
                            and any(n in r.getMessage() for n in noted))
    logging.getLogger("absl").addFilter(unsaid)
    try:
      self._mngr = ocp.CheckpointManager(path, options=options, item_handlers=handlers)
    finally:
      logging.getLogger("absl").removeFilter(unsaid)

  @property
  def set_aside(self) -> list[str]:
    """The step folders moved aside (`<step>.uncommitted`, `<step>.replaced`, ...), those noted
    when the run opened the folder moved first (`tidy`): the run reads them to say so once its
    checks have passed."""
    self.tidy()
    return self._set_aside

  def tidy(self) -> None:
    """Moves aside the folders noted when the run opened the folder (uncommitted steps, those
    newer than checkpoint.restore_step), once: when the run says what it set aside, or before it
    saves, so that a run that stops with an error before training leaves the folder as it found
    it. Every process calls it (a barrier), as it calls `save`."""
    if self._tidied:
      return
    self._tidied = True
    if distributed.is_main():
      self._set_aside += [move_aside(self.path, step, why) for step, why in self._aside]
    distributed.barrier("checkpoint_tidy")
    if self._aside or jax.process_count() > 1:
      self._mngr.reload()  # orbax listed the folders as steps when it opened the folder

  def latest_step(self) -> int | None:
    steps = [s for s in complete_steps(self.path) if (s, "replaced") not in self._aside]
    return steps[-1] if steps else None

  def resume_step(self, wanted: int = 0) -> int | None:
    """The step to resume from: the newest (`wanted` = 0) or `wanted`, whose newer steps are then
    moved aside (the run writes its own); None when there is none (step 0 is one: the weights
    tools.hf import writes)."""
    steps = complete_steps(self.path)
    if not wanted:
      return steps[-1] if steps else None
    if wanted not in steps:
      raise CheckpointError(
          f"checkpoint.restore_step={wanted}: {self.path} holds no complete step {wanted}; it "
          f"holds {', '.join(map(str, steps)) or 'none'}.")
    self._aside += [(s, "replaced") for s in steps if s > wanted]  # moved by `tidy`
    return wanted

  def set_aside_step(self, step: int, why: str) -> None:
    """Moves a saved step aside as `<step>.<why>` (kept on disk, no longer a step)."""
    self.tidy()
    if distributed.is_main():
      self._set_aside.append(move_aside(self.path, step, why))
    distributed.barrier("checkpoint_set_aside")
    self._mngr.reload()

  def save(self, step: int, state: dict[str, ModuleState], cfg: Config, force: bool = False,
           params_only: bool = False, compact: bool = False):
    """Saves `step` (asynchronously unless the checkpointer says otherwise). `params_only`: the
    parameters alone (an import's step 0, whose optimizer state is its fresh one: restoring builds
    it again), a third of the bytes to copy to the host; it pins no data (no fingerprint).
    `compact` (one process): a parameter whose float32 values are all bfloat16 values (weights
    imported from a bfloat16 checkpoint) is stored as bfloat16, half the bytes; restoring reads it
    back as the same float32 values. The config is stored with its paths absolute
    (run_paths.absolute): the tools that read it run from other directories. The folders noted
    to be moved aside are moved first (`tidy`)."""
    self.tidy()
    meta = {"step": step, "modules": self.modules,
            "config": dataclasses.asdict(run_paths.absolute(cfg)),
            "data": {"steps_done": step, "samples_consumed": step * cfg.data.global_batch,
                     **{k: v for k, (_, v) in data_values(cfg).items()}},
            "rng": {"train_seed": cfg.train.seed, "data_seed": cfg.data.seed}}
    trees = {n: {"params": s.params} if params_only else
             {"params": s.params, "opt_state": s.opt_state} for n, s in state.items()}
    if self.base is not None and not params_only:  # the frozen weights stay in the base's step
      frozen = {n: {k[len("params/"):] for k in self.base.fingerprints.get(n, {})} for n in trees}
      trees = {n: dict(t, params=without(t["params"], frozen[n])) for n, t in trees.items()}
      meta["base"] = self.base.as_meta()
    if params_only:
      meta["params_only"] = True
    else:
      meta["data"]["fingerprint"] = self.data_fingerprint(cfg)
    meta["fingerprints"] = {n: fingerprint.on_device(t) for n, t in trees.items()}
    meta["digest"] = digest(meta)
    if compact and jax.process_count() == 1:
      trees = {n: dict(t, params=jax.tree.map(bfloat16_if_exact, t["params"]))
               for n, t in trees.items()}
    if jax.process_count() > 1:
      trees = {n: t if layout.spans_processes(t) else layout.to_global(t) for n, t in trees.items()}
      layout.settle(trees)
    items = {n: ocp.args.PyTreeSave(t) for n, t in trees.items()}
    items[META] = ocp.args.JsonSave(meta)
    self._trees.clear()
    self._mngr.save(step, args=ocp.args.Composite(**items), force=force)
    return meta

  def data_fingerprint(self, cfg: Config) -> dict:
    """`data.identity.fingerprint(cfg)`, computed once per data directory."""
    key = (cfg.data.task, cfg.data.dir)
    if key not in self._data:
      self._data[key] = identity.fingerprint(cfg)
    return self._data[key]

  def read_meta(self, step: int) -> dict:
    quiet_failed_reads()
    try:
      meta = self._mngr.restore(step, args=ocp.args.Composite(
          **{META: ocp.args.JsonRestore()}))[META]
      wrong = digest_failure(meta)
      failed = wrong and f"has metadata that {wrong} ({meta_file(self.path, step)})"
    except Exception as e:  # pylint: disable=broad-except
      failed = f"has no readable metadata ({read_failure(e, self._step_dir(step))})"
    if failed:
      self._fail(step, failed)
    return meta

  def saved_arrays(self, step: int, modules: list[str]) -> dict[str, dict]:
    """Each module's saved arrays by path (`params/...`, `opt_state/...`): their metadata, as
    orbax recorded the tree it wrote."""
    trees = self._saved_trees(step, modules)
    return {n: fingerprint.paths(t) for n, t in trees.items()}

  def _saved_trees(self, step: int, modules) -> dict:
    """orbax's metadata of each module's saved tree: read once a step (orbax opens every array
    for it, a second or more for a model's state), until this checkpointer saves again."""
    quiet_failed_reads()
    try:
      if step not in self._trees:
        self._trees[step] = self._mngr.item_metadata(step)
      items = self._trees[step]
      trees = {n: getattr(items[n], "tree", items[n]) for n in modules}
      if any(t is None for t in trees.values()):
        raise ValueError("no tree metadata")
    except Exception as e:  # pylint: disable=broad-except
      self._fail(step, f"could not be restored: {read_failure(e, self._step_dir(step))}")
    return trees

  def read(self, step: int, wanted: dict[str, dict], meta: dict) -> dict[str, dict]:
    """The arrays `wanted` names (per module: path -> abstract array with this run's sharding)
    read from `step` by its saved structure, the rest of it left on disk (orbax placeholders);
    each read in the dtype it was saved in, checked against its saved fingerprint, then cast to
    the wanted dtype (a frozen leaf saved in float32, read into a bfloat16 run, or the reverse).
    Per module: path -> array."""
    multi = jax.process_count() > 1
    gathered = {n for n, w in wanted.items() if multi and w and not layout.spans_processes(w)}
    targets = {n: layout.global_abstract(w) if n in gathered else w for n, w in wanted.items()}
    args, checks = {}, None
    saved_trees = self._saved_trees(step, list(targets))
    try:
      for n, target in targets.items():
        item = jax.tree_util.tree_map_with_path(
            lambda p, x, t=target: as_saved(t[path_str(p)], x) if path_str(p) in t else
            ocp.PLACEHOLDER, saved_trees[n])
        restore_args = jax.tree.map(
            lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=t.shape,
                                           dtype=t.dtype)
            if isinstance(t, jax.ShapeDtypeStruct) else ocp.RestoreArgs(), item)
        args[n] = ocp.args.PyTreeRestore(item=item, restore_args=restore_args)
      if not multi:  # the fingerprints' programs compile while the arrays are read
        checks = fingerprint.compile_ahead([
            {k: a for k, a in fingerprint.paths(args[n].item).items()
             if isinstance(a, jax.ShapeDtypeStruct)} for n in targets])
      restored = self._mngr.restore(step, args=ocp.args.Composite(**args))
      got = {n: {k: v for k, v in fingerprint.paths(restored[n]).items() if k in targets[n]}
             for n in targets}
      failed = None
    except Exception as e:  # pylint: disable=broad-except
      if xla_errors.out_of_memory(e):  # a device's memory, not the step's files: raised as it is
        if checks is not None:
          checks.join()
        raise
      got, failed = None, f"could not be restored: {read_failure(e, self._step_dir(step))}"
    if checks is not None:
      checks.join()
    if failed:
      self._fail(step, failed)
    if multi:
      got = {n: layout.from_global(got[n], wanted[n]) if n in gathered else got[n] for n in got}
      layout.settle(got)
    saved = meta.get("fingerprints", {})
    bad = [m for n in got if n in saved for m in mismatches(saved[n], got[n], n)]
    if bad:
      self._fail(step, f"does not match the fingerprints saved with it ({', '.join(bad[:3])}"
                 f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''})")
    return {n: {k: v if v.dtype == wanted[n][k].dtype else v.astype(wanted[n][k].dtype)
                for k, v in g.items()} for n, g in got.items()}

  def checked_meta(self, step: int, cfg: Config) -> dict:
    """The metadata of `step`, checked against `cfg` (`check_compatible`): what `restore` checks
    first, for a run to call before it starts anything else."""
    meta = self.read_meta(step)
    self.notes += check_compatible(meta, cfg, self.path, step)
    self.notes += filter(None, [step_record_note(self._step_dir(step))])  # its damaged record
    return meta

  def restore(self, step: int, abstract: dict[str, dict], cfg: Config, fresh_opt_state=None,
              meta: dict | None = None) -> tuple[dict[str, ModuleState], dict]:
    """Restores `step` onto the shardings in `abstract`; checks it matches `cfg` first (unless
    `meta` is `checked_meta`'s), and every array read against the fingerprint saved with it.
    Optimizer state is read by the saved structure and mapped onto this run's group by group: a
    group the step has no state for (trained now, frozen then; or a step saved with parameters
    only) gets its part of `fresh_opt_state(module, params)`, a group frozen now leaves its state
    on disk."""
    if meta is None:
      meta = self.checked_meta(step, cfg)
    where = f"checkpoint {self.path} step {step}"
    saved = self.saved_arrays(step, list(abstract))
    wanted = {n: fingerprint.paths(a) for n, a in abstract.items()}
    params = {n: {k: a for k, a in w.items() if k.startswith("params/")}
              for n, w in wanted.items()}
    from_base = self.left_to_base(meta, saved, params)
    differ = [d for n in abstract for d in shape_differences(
        saved[n], {k: a for k, a in params[n].items() if k not in from_base[n]}, n)]
    if differ:
      raise CheckpointError(
          f"{where} holds other parameters than this run's model ({'; '.join(differ[:3])}"
          f"{f'; {len(differ) - 3} more' if len(differ) > 3 else ''}); the model config matches, "
          "so the model code differs: resume with the code that wrote it, or train this model "
          "afresh in a new workdir with --config.run.workdir=NEW_DIR.")
    opt = {n: {k: a for k, a in w.items() if k.startswith("opt_state/")} for n, w in wanted.items()}
    fresh = {n: [k for k, a in o.items() if k not in saved[n] or
                 tuple(saved[n][k].shape) != tuple(a.shape)] for n, o in opt.items()}
    if any(fresh.values()) and fresh_opt_state is None:
      raise ValueError(f"step {step} of {self.path} lacks optimizer state this run has; "
                       "restoring it needs the optimizer's fresh state.")
    read = {n: {k: a for k, a in wanted[n].items() if k not in fresh[n] and k not in from_base[n]}
            for n in abstract}
    arrays = self.read(step, read, meta)
    for n, got in self.read_base(step, meta, from_base).items():
      arrays[n].update(got)
    state = {}
    for n, tree in abstract.items():
      module = fill(tree["params"], {k[len("params/"):]: v for k, v in arrays[n].items()
                                      if k.startswith("params/")})
      saved_opt = {k[len("opt_state/"):]: v for k, v in arrays[n].items()
                   if k.startswith("opt_state/")}
      if fresh[n]:  # the new groups start afresh, at this step of the LR schedule
        start = optim.at_step(fresh_opt_state(n, module), step)
        opt_state = fill(start, saved_opt, keep_others=True)
      else:
        opt_state = fill(tree["opt_state"], saved_opt)
      state[n] = ModuleState(module, opt_state)
    if not meta.get("params_only"):
      self.notes += regrouped(meta, cfg, step, saved, fresh, opt)
    return state, meta

  @staticmethod
  def left_to_base(meta: dict, saved: dict, params: dict) -> dict:
    """Per module, the parameters of `params` (path -> abstract array) that the step does not
    hold and leaves to its base (`meta["base"]`, a LoRA run's frozen weights)."""
    named = (meta.get("base") or {}).get("fingerprints", {})
    return {n: {k: a for k, a in p.items() if k not in saved[n] and k in named.get(n, {})}
            for n, p in params.items()}

  def read_base(self, step: int, meta: dict, wanted: dict) -> dict:
    """The frozen weights `wanted` (per module: path -> abstract array) that `step` leaves to
    its base, read from the base's step after checking that it holds the weights the run was
    trained on (its fingerprints, as the step recorded them). A file or folder of the base that
    this user may not read (a folder that may be entered but not listed too) is PermissionDenied
    naming it, as the run's own are, with checkpoint.base as the other fix."""
    if not any(wanted.values()):
      return {n: {} for n in wanted}
    folder = base_folder(self.path, meta["base"]["path"], self.moved_base)
    try:
      return self._base_weights(step, meta["base"], folder, wanted)
    except (PermissionError, PermissionDenied) as e:  # listed here, or read (`_fail`)
      path = e.path if isinstance(e, PermissionDenied) else e.filename or folder
      raise PermissionDenied(os.fspath(path), base_of=step) from None

  def _base_weights(self, step: int, b: dict, folder: str, wanted: dict) -> dict:
    named = f"{folder} step {b['step']}"
    where = f"checkpoint {self.path} step {step} holds its trained weights; its frozen base"
    move = ("put it back, or name the folder that holds that step now with "
            "--config.checkpoint.base=DIR (a workdir or its checkpoints folder)")
    if b["step"] not in complete_steps(folder):
      raise CheckpointError(f"{where} weights are in {named}, which is not there (moved or "
                            f"deleted): {move}.")
    own = os.path.abspath(folder) == os.path.abspath(self.path)
    held = [d for d in sorted(os.listdir(os.path.join(folder, str(b["step"]))))
            if d != META and os.path.isdir(os.path.join(folder, str(b["step"]), d))]
    ckpt = self if own else Checkpointer(folder, held, read_only=True)
    try:
      base_meta = ckpt.read_meta(b["step"])
      got = base_meta.get("fingerprints", {})
      changed = [f"{n} {k}" for n, w in wanted.items() for k in w
                 if got.get(n, {}).get(k) != b["fingerprints"][n][k]]
      if changed:
        raise CheckpointError(
            f"{where} weights were those of {named}, which now holds other weights "
            f"({', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''} differ): {move} "
            "(the weights the run was trained on), or start a new run.workdir.")
      got = ckpt.read(b["step"], {n: w for n, w in wanted.items() if w}, base_meta)
      return {n: got.get(n, {}) for n in wanted}
    finally:
      if not own:
        ckpt.close()

  def _step_dir(self, step: int) -> str:
    return os.path.join(self.path, str(step))

  def _fail(self, step: int, what: str):
    """Raises the error for a step that cannot be read, once the failed read is released (outside
    the `except` block, whose exception holds it): PermissionDenied naming a file or folder of
    the step this user may not read, if there is one (its permissions, not damage), else the
    error for a damaged step (`damaged`)."""
    self._failed = True
    collect()  # the failed read's leftovers already garbage, while their reports are dropped
    denied = unreadable(os.path.join(self.path, str(step)))
    if denied:
      raise PermissionDenied(denied)
    raise CheckpointError(damaged(self.path, step, what, self.source))

  def wait(self) -> None:
    self._mngr.wait_until_finished()

  def close(self) -> None:
    try:
      self._mngr.wait_until_finished()  # raises a save's failure
    finally:
      self._mngr.close()
      if self._made:
        try:
          os.rmdir(self.path)  # only if empty: nothing was saved
        except OSError:
          pass
    if self._failed:
      collect()
