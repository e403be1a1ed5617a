"""Post-training loops: ES and GRPO on a verifiable task, or GRPO then ES, in one resumable run.

A run directory holds run.json (the run's identity, fastes/run/rundir.py), config.json, metrics.jsonl (one
line per step), checkpoints/ and, at the end, final/ (a Hugging Face model directory). Everything random
is derived from (seed, phase, step), so a run resumed from a checkpoint continues exactly as the
uninterrupted run would have.

train() = prepare_run (checks, model, settings, run directory, resume point), run_phases (the steps of
each phase: es_iteration in fastes/run/es_loop.py, grpo_step in fastes/run/grpo_loop.py) and finish_run (final
model, summary.json).
What the phases share (Run, the prompts of a step) is in fastes/run/shared.py.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from fastes import distributed
from fastes.checkpoint import latest_checkpoint, save_checkpoint, tensors_under, write_atomic
from fastes.errors import ConfigError, NonFiniteUpdateError
from fastes.es.optimizer import ES, CollectiveError
from fastes.models import adapters
from fastes.models.loading import ModelError, is_character_tokenizer, load_model, num_params, save_model
from fastes.models.sources import resolve_model
from fastes.tasks import DatasetTask, Example, Task
from fastes.tasks.setup import make_task, task_errors

from . import auto_settings, rundir
from .callbacks import TENSORBOARD_DIR, Callbacks, TensorBoardCallback
from .config import ESSettings, TrainConfig, es_key
from .es_loop import PartTimer, es_iteration, evolved_weights, make_es
from .evaluation import Evaluator, rates
from .grpo_loop import grpo_step, make_grpo_optimizer
from .shared import Run, long_lived_objects_frozen, reward_parts
from .size_checks import check_sizes

PHASES = {"es": ("es",), "grpo": ("grpo",), "grpo_es": ("grpo", "es")}
GRPO_CHECKSUM_EVERY = 10  # GRPO steps between the cross-process weight checks (ES has its own)


@torch.no_grad()
def evaluate(run: Run, examples: list[Example]) -> dict[str, Any]:
    """Greedy accuracy, format rate and (instruct forms) lenient accuracy of the current weights on
    `examples` (shared by the processes), and which examples it solves (1.0 / 0.0 each, in order)."""
    rank, world = distributed.rank_and_world()
    mine = examples[rank::world]
    greedy = Evaluator(run.cfg, run.model, run.tokenizer).greedy(run.task, mine)
    every = distributed.gather_strided(torch.tensor(greedy.correct, dtype=torch.float64), len(examples))
    totals = distributed.all_sum(greedy.totals()).tolist()
    result = {**rates(totals, len(examples), greedy.lenient is not None), "correct": every.tolist()}
    return {**result, "record": _eval_record(result, reward_parts(run.task, greedy.scores))}


def _eval_record(result: dict[str, Any], parts: dict[str, float]) -> dict[str, float]:
    """An evaluation's metrics.jsonl keys; with several reward functions also the weighted reward
    (= test_accuracy) and each function's mean under TRL's names."""
    record = {"test_accuracy": result["accuracy"], "test_format": result["format"]}
    if "lenient_accuracy" in result:
        record["test_lenient_accuracy"] = result["lenient_accuracy"]
    if parts:
        record["test_reward"] = result["accuracy"]
        record.update({f"test_{k}": v for k, v in parts.items() if k.endswith("/mean")})
    return record


def paired_gain(before: list[float], after: list[float]) -> tuple[float, float]:
    """Mean per-problem gain of `after` over `before` on the same problems, and its standard error.

    Pairing removes the problem-to-problem variance that two independent accuracies would carry, so a
    gain of 3 standard errors is a real improvement, not a lucky test set.
    """
    diff = torch.tensor(after, dtype=torch.float64) - torch.tensor(before, dtype=torch.float64)
    se = float(diff.std(correction=1) / math.sqrt(len(diff))) if len(diff) > 1 else math.inf
    return float(diff.mean()), se


NO_SIGNAL_STEPS = 3  # steps in a row where every member (ES) or every group (GRPO) scored alike


class NoSignal:
    """Counts the steps in a row that had nothing to learn from: every ES member scored the same
    (reward_std 0), or every GRPO group's completions did (frac_reward_zero_std 1)."""

    def __init__(self) -> None:
        self.streak = 0

    def update(self, record: dict[str, Any]) -> bool:
        """Count `record`'s step; True when the streak has just reached NO_SIGNAL_STEPS (warn once)."""
        flat = record.get("frac_reward_zero_std", 0.0) == 1.0 or record.get("reward_std", 1.0) == 0.0
        self.streak = self.streak + 1 if flat else 0
        return self.streak == NO_SIGNAL_STEPS

    def warning(self, phase: str) -> str:
        who = "every member" if phase == "es" else "every group of completions"
        return (
            f"fastes: warning: {who} scored the same for {NO_SIGNAL_STEPS} {phase.upper()} steps in a row "
            "(reward_std 0), so nothing can be learned. Usual causes: the task is too hard or too easy for "
            "the model (look at its answers: fastes eval --show 5), answers cut short by max_new_tokens, a "
            "prompt form the verifier does not read (prompt_style, chat_template), or a sigma too small to "
            "change any answer"
        )


def progress_fields(record: dict[str, Any], no_signal: bool) -> dict[str, str]:
    """The progress bar's postfix: phase, reward, test accuracy, and where the step's time went."""
    fields = {
        "phase": record["phase"],
        "reward": f"{record['reward']:.3f}",
        "test": f"{record.get('test_accuracy', float('nan')):.3f}",
    }
    if no_signal:
        fields["signal"] = "NONE"
    parts = {part: record.get(f"time/{part}") for part in PartTimer.PARTS}
    if all(seconds is not None for seconds in parts.values()):
        fields["time"] = " ".join(f"{part} {seconds:.1f}s" for part, seconds in parts.items())
    return fields


# --- the run ----------------------------------------------------------------------------------------


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """AdamW state split into tensors (for safetensors) and plain JSON (param groups, tensor names)."""
    state = optimizer.state_dict()
    tensors, layout = {}, {}
    for index, values in state["state"].items():
        for name, value in values.items():
            tensors[f"optimizer.{index}.{name}"] = value
            layout.setdefault(str(index), []).append(name)
    return tensors, {"param_groups": state["param_groups"], "layout": layout}


def _load_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], saved: dict) -> None:
    state = {
        int(i): {n: tensors[f"optimizer.{i}.{n}"] for n in names} for i, names in saved["layout"].items()
    }
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def _checkpoint(run: Run, global_step: int, phase_index: int, step: int, es: ES | None, optimizer) -> None:
    if not distributed.is_writer():  # every process holds the same state; one writes it
        return
    tensors = {f"model.{k}": v for k, v in adapters.checkpoint_state(run.model).items()}
    state: dict[str, Any] = {
        "phase_index": phase_index,
        "step": step,
        "run": run.identity,
        "metrics": run.metrics,  # metrics.jsonl up to here: rewritten from this on resume
    }
    if es is not None:
        state["es"] = es.state_dict()
    if optimizer is not None:
        opt_tensors, state["optimizer"] = _optimizer_tensors(optimizer)
        tensors.update(opt_tensors)
    if run.cfg.grpo.sync_ref_model and run.reference is not None:  # the reference moves with the policy
        tensors.update({f"reference.{k}": v for k, v in run.reference.state_dict().items()})
    path = save_checkpoint(run.out_dir, global_step, tensors, state)
    run.callbacks.fire("on_save", global_step, path)


def check_task(task: Task, cfg: TrainConfig) -> None:
    # Rows given as a dataset may come without held-out rows: such a run skips evaluation, as TRL does.
    splits = ("train",) if isinstance(task, DatasetTask) else ("train", "test")
    for split in splits:
        with task_errors():
            examples = task.split(split)  # a generated task draws its problems now
        if not examples:
            raise ConfigError(f"task: {cfg.task!r} has no {split} problems; add some, or choose another task")


def _check_evolvable(model: torch.nn.Module, model_dir: Path, es: ESSettings) -> None:
    adapters.check_es(model, es.eval_mode)
    try:
        evolved_weights(model, es)
    except ValueError as error:
        if es.evolve:  # the name filter matches nothing
            raise ConfigError(f"es.evolve: {error}") from None
        raise ModelError(f"{model_dir}: {error}. ES cannot train it; use algorithm = 'grpo'") from None


def _resume_point(
    out_dir: Path, identity: dict[str, Any], phases: tuple[str, ...]
) -> tuple[tuple[int, dict, dict] | None, str]:
    """The newest checkpoint of the run in out_dir (None: none written yet), after checking that this is
    the same run: same settings (the length may grow) and the same starting model."""
    saved = rundir.saved_identity(out_dir)
    found = latest_checkpoint(out_dir)
    if found is None and saved is None:
        raise rundir.RunDirError(
            f"--resume: {out_dir} holds no run to resume (no {rundir.RUN_FILE}, no checkpoints); "
            "start a new run without --resume"
        )
    recorded, finished = saved, ()
    if found is not None:
        step, _, state = found
        recorded = rundir.checkpoint_identity(state, out_dir / "checkpoints" / f"step-{step:08d}", saved)
        ended = phases[: state["phase_index"]]
        finished = tuple("grpo.steps" if p == "grpo" else "es.iterations" for p in ended)
    rundir.check_resume(identity, recorded, out_dir, finished)
    return found, recorded["run_id"]


def train(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    task: Task | None = None,
    callbacks: list[Any] | None = None,
    peft_config: Any = None,
) -> dict[str, Any]:
    """Run the configured post-training; returns base and final test metrics.

    `model` and `tokenizer` (loaded objects, trained in place) replace loading cfg.model; without
    cfg.model the run's identity fingerprints the model's weights instead of its files. A tokenizer
    alone replaces the one in cfg.model's directory. `task` replaces make_task(cfg) (rows and reward
    functions given in code: fastes.ESTrainer). `callbacks` get the run's hooks (fastes/run/callbacks.py),
    after TensorBoard's when cfg.report_to asks for it. `peft_config` (a peft.PeftConfig) trains a new
    adapter on the model instead of its weights (fastes.models.adapters); a peft.PeftModel given as `model`
    trains its own adapter.

    A new run needs a new or empty out_dir; `overwrite` lets it replace a previous run there. `resume`
    continues the run in out_dir from its newest checkpoint, exactly, with that run's own settings (only
    es.iterations / grpo.steps may be raised). Everything that can be checked is checked before any work.
    Under torchrun the processes run one job (fastes.distributed): ES shares the population, GRPO the
    prompts of each batch, rank 0 alone reads and writes the run directory, and the others get what it
    read (the checkpoint to resume from).
    """
    device, joined = distributed.setup(cfg.device, cfg.collective_timeout)  # ES and GRPO alike
    threads = torch.get_num_threads()  # prepare_run sets the run's own count; the caller gets its own back
    try:
        run, start = prepare_run(
            cfg,
            resume=resume,
            overwrite=overwrite,
            device=device,
            given=(model, tokenizer),
            task=task,
            callbacks=callbacks,
            peft_config=peft_config,
        )
        global_step, last_eval = run_phases(run, start)
        result = finish_run(run, global_step, last_eval)
    except CollectiveError:
        raise  # the group is broken: leaving it would wait for the lost peer (the CLI exits at once)
    except BaseException:
        distributed.teardown(joined)
        raise
    finally:
        torch.set_num_threads(threads)
    distributed.teardown(joined)
    return result


def check_world_size(cfg: TrainConfig, task: Task) -> None:
    """Before any work: the processes must be able to share the population and the prompts equally."""
    phases = PHASES[cfg.algorithm]
    if "es" in phases:
        distributed.require_divisible(
            cfg.es.population, "es.population", "each process evaluates an equal share of the members"
        )
    if "grpo" in phases:
        prompts = min(cfg.batch_size, len(task.split("train")))
        distributed.require_divisible(
            prompts, "GRPO prompts per step (batch_size)", "each process samples an equal share of them"
        )


@dataclass
class Start:
    """Where run_phases begins: at the beginning, or just after the newest checkpoint."""

    phase_index: int = 0
    step: int = 0  # steps of that phase already taken
    global_step: int = 0  # steps of every phase already taken
    state: dict | None = None  # the checkpoint's state (None: a fresh start), with its phase's ES / optimizer
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # the checkpoint's tensors


def prepare_run(
    cfg: TrainConfig,
    *,
    resume: bool,
    overwrite: bool,
    device: str,
    given: tuple[torch.nn.Module | None, Any],
    task: Task | None,
    callbacks: list[Any] | None,
    peft_config: Any = None,
) -> tuple[Run, Start]:
    """Everything before the first step: check the settings, load the model, choose the automatic
    settings, make the task, check (or start) the run directory, and restore the newest checkpoint on
    resume. Everything that can be checked is checked before the run directory is touched."""
    for name, value in (("resume", resume), ("overwrite", overwrite)):
        if not isinstance(value, bool):  # "no" is truthy: a run would be deleted
            raise ConfigError(f"{name}: must be True or False, got {type(value).__name__} {value!r}")
    if resume and overwrite:
        raise rundir.RunDirError("--resume continues the run in out_dir, --overwrite deletes it: choose one")
    out_dir = Path(cfg.out_dir)
    distributed.from_writer(lambda: rundir.check_writable(out_dir))  # rank 0 writes; every rank stops
    model, tokenizer, model_dir, in_memory = _load_policy(cfg, given, device, peft_config)

    # Settings left on auto are chosen now, once, by rank 0 for every process (free memory differs between
    # them), and saved with the run: a resume takes them from there. The choices are valid by
    # construction (tests/test_prompting.py), so the files that `cfg` names are not read again here.
    def choose() -> TrainConfig:
        saved_run = rundir.saved_identity(out_dir) if resume else None
        return auto_settings.resolve(cfg, model, tokenizer, saved_run["config"] if saved_run else None)

    cfg = distributed.from_writer(choose)
    task = task or make_task(cfg, strict_alphabet=is_character_tokenizer(tokenizer))
    check_task(task, cfg)
    check_world_size(cfg, task)
    # A step that cannot fit fails now, with its estimate.
    check_sizes(cfg, model, PHASES[cfg.algorithm], len(task.split("train")))
    hooks = _hooks(cfg, callbacks)  # checked before any work
    model_sha = rundir.weights_fingerprint(model) if in_memory else None
    if adapters.is_peft_model(model):  # the adapter's settings and starting tensors identify the run too
        base = model_sha or rundir.model_fingerprint(adapters.base_directory(model_dir))
        model_sha = adapters.fingerprint(model, base)
    identity = rundir.run_identity(
        cfg,
        model_dir,
        model_sha=model_sha,
        task_sha=task.fingerprint() if isinstance(task, DatasetTask) else None,
    )
    distributed.require_same(identity["run_id"], "settings or starting model")
    phases = PHASES[cfg.algorithm]
    found, run_id, previous = _read_run_dir(out_dir, identity, phases, resume, overwrite)
    if "es" in phases:
        _check_evolvable(model, model_dir, cfg.es)
    torch.set_num_threads(auto_settings.torch_threads(num_params(model), cfg.threads))
    run = Run(cfg, model, tokenizer, task, out_dir, identity, callbacks=hooks)
    task.attach(tokenizer=tokenizer, device=next(model.parameters()).device)  # reward models run here
    run.test = task.split("test")[: cfg.eval_size]
    # GRPO's KL reference is the starting model, also when the run resumes with trained weights.
    if "grpo" in phases and cfg.grpo.beta > 0:
        if adapters.is_peft_model(model):  # the base model (adapter off) or the starting adapter: no copy
            if cfg.grpo.sync_ref_model:
                raise ConfigError(
                    "grpo.sync_ref_model: not with a PEFT adapter, whose reference is the starting model "
                    "without a copy to move; turn it off"
                )
            run.reference = adapters.StartingAdapter(model)
        else:
            run.reference = copy.deepcopy(model).eval().requires_grad_(False)
    if distributed.is_writer():  # the first write to the run directory
        if not resume:
            rundir.remove_run(out_dir, previous)
        rundir.clean(out_dir)
        rundir.start_run(out_dir, identity)  # on resume: records a raised length
    return run, _restore(run, found, run_id)


def _hooks(cfg: TrainConfig, callbacks: list[Any] | None) -> Callbacks:
    """The run's callbacks, after TensorBoard's when cfg.report_to asks for it."""
    hooks = Callbacks(callbacks, args=cfg, max_steps=sum(phase_lengths(cfg)))
    if cfg.report_to == "tensorboard":
        hooks.callbacks.insert(
            0, TensorBoardCallback(Path(cfg.out_dir) / TENSORBOARD_DIR, every=cfg.logging_steps)
        )
    return hooks


def _read_run_dir(
    out_dir: Path, identity: dict[str, Any], phases: tuple[str, ...], resume: bool, overwrite: bool
) -> tuple[tuple[int, dict, dict] | None, str | None, list[Path]]:
    """Rank 0 reads the run directory; every rank gets what it found (or the error it raised): on resume
    the checkpoint to resume from (None: none yet) and the run's id, else what a new run would replace."""
    if resume:
        found, run_id = distributed.from_writer(lambda: _resume_point(out_dir, identity, phases))
        return found, run_id, []
    return None, None, distributed.from_writer(lambda: rundir.check_fresh(out_dir, overwrite))


def _load_policy(
    cfg: TrainConfig, given: tuple[torch.nn.Module | None, Any], device: str, peft_config: Any = None
) -> tuple[torch.nn.Module, Any, Path, bool]:
    """The model and tokenizer to train (given in code, or loaded from cfg.model, with a new adapter of
    `peft_config`), the directory that identifies the model, and whether it lives only in memory (no
    files: its weights are fingerprinted)."""
    model, tokenizer = given
    if model is not None and tokenizer is None:
        raise ConfigError("model: a loaded model needs its tokenizer too (processing_class)")
    in_memory = model is not None and not cfg.model  # no files to fingerprint: its weights' hash instead
    if in_memory:
        model_dir = Path(f"<in-memory {type(model).__name__}>")
    else:
        model_dir = resolve_model(cfg.model)  # a .gguf file or a shipped model: its converted directory
    torch.manual_seed(cfg.seed)
    if model is None:
        model, loaded = load_model(model_dir, dtype=cfg.dtype, device=device)
        tokenizer = tokenizer or loaded
    model = adapters.prepare(model, peft_config, cfg.seed)
    return model, tokenizer, model_dir, in_memory


def _restore(run: Run, found: tuple[int, dict, dict] | None, run_id: str | None) -> Start:
    """Load the newest checkpoint (`found`) into the run, or start metrics.jsonl afresh. `run_id`: the
    resumed run's (None: a new run)."""
    writer = distributed.is_writer()
    if found is None:
        if run_id is not None and writer:
            print(f"Resuming run {run_id} from step 0: no checkpoint was written yet, so it starts over")
        if writer:
            rundir.write_metrics(run.out_dir, [])
        return Start()
    global_step, tensors, saved = found
    if writer:
        print(f"Resuming run {run_id} from step {global_step} ({run.out_dir})")
    adapters.load_checkpoint_state(run.model, tensors_under(tensors, "model."))
    reference = tensors_under(tensors, "reference.")
    if reference and run.reference is not None:  # sync_ref_model: where the synced reference had got to
        run.reference.load_state_dict(reference)
    run.metrics = list(saved["metrics"])
    if writer:
        rundir.restore_metrics(run.out_dir, run.metrics, global_step)
    phase_index, step = saved["phase_index"], saved["step"]
    lengths = phase_lengths(run.cfg)
    return Start(phase_index, step, sum(lengths[:phase_index]) + step, saved, tensors)


def phase_lengths(cfg: TrainConfig) -> list[int]:
    """Steps of each phase of cfg.algorithm."""
    return [cfg.grpo.steps if p == "grpo" else cfg.es.iterations for p in PHASES[cfg.algorithm]]


def run_phases(run: Run, start: Start) -> tuple[int, dict[str, Any] | None]:
    """Evaluate the starting weights (a fresh start), then take the steps of each phase from `start` on;
    returns the global step reached and the last evaluation made (None: none since `start`)."""
    cfg, phases, lengths = run.cfg, PHASES[run.cfg.algorithm], phase_lengths(run.cfg)
    global_step, last_eval = start.global_step, None
    run.task.at_step(global_step, sum(lengths))  # reward functions' trainer_state.global_step
    if distributed.is_writer():
        run.callbacks.fire("on_train_begin", global_step)
    if start.state is None and run.test:
        base = evaluate(run, run.test)
        if distributed.is_writer():  # the base's per-problem results, for the paired gain at the end
            write_atomic(run.out_dir / "base_test.json", json.dumps(base["correct"]))
        run.log({"global_step": 0, "phase": "base", "step": 0, **base["record"]})
    no_signal = NoSignal()
    quiet = not cfg.progress or not distributed.is_writer()
    bar = tqdm(total=sum(lengths), initial=global_step, disable=quiet, desc=cfg.algorithm)
    # the objects made so far live as long as the run: no full garbage collection needs to walk them
    with long_lived_objects_frozen():
        for phase_index in range(start.phase_index, len(phases)):
            phase = phases[phase_index]
            resumed = start if phase_index == start.phase_index else Start()
            es, optimizer = _phase_state(run, phase, resumed)
            for step in range(resumed.step, lengths[phase_index]):
                if es is not None:
                    try:
                        record = es_iteration(run, es, step)
                    except NonFiniteUpdateError as error:  # name the run's keys, not fastes.ES's arguments
                        raise error.renamed(es_key) from None
                else:
                    record = grpo_step(run, optimizer, run.reference, step)
                global_step += 1
                run.task.at_step(global_step)
                record = {"global_step": global_step, "phase": phase, "step": step + 1, **record}
                last = step + 1 == lengths[phase_index]
                if run.test and (cfg.eval_every and (step + 1) % cfg.eval_every == 0 or last):
                    last_eval = evaluate(run, run.test)
                    record.update(last_eval["record"])
                run.log(record)
                _show(record, no_signal, bar)
                if phase == "grpo" and (step + 1) % GRPO_CHECKSUM_EVERY == 0:
                    distributed.check_same_weights(run.model.parameters(), f"GRPO step {step + 1}")
                if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                    _checkpoint(run, global_step, phase_index, step + 1, es, optimizer)
            if phase_index + 1 < len(phases):  # a phase boundary is a checkpoint: the next phase starts fresh
                _checkpoint(run, global_step, phase_index + 1, 0, None, None)
    bar.close()
    return global_step, last_eval


def _phase_state(run: Run, phase: str, resumed: Start) -> tuple[ES | None, torch.optim.Optimizer | None]:
    """The phase's ES or GRPO optimizer, with the checkpoint's state when it resumes the phase.
    A checkpoint at a phase boundary carries no optimizer state: the next phase starts fresh."""
    es = make_es(run) if phase == "es" else None
    optimizer = make_grpo_optimizer(run) if phase == "grpo" else None
    saved = resumed.state
    if saved is not None:
        if es is not None and "es" in saved:
            es.load_state_dict(saved["es"])
        if optimizer is not None and "optimizer" in saved:
            _load_optimizer(optimizer, resumed.tensors, saved["optimizer"])
    return es, optimizer


def _show(record: dict[str, Any], no_signal: NoSignal, bar: tqdm) -> None:
    """The step on the progress bar, and a warning once steps in a row had nothing to learn from."""
    if no_signal.update(record) and distributed.is_writer():
        tqdm.write(no_signal.warning(record["phase"]), file=sys.stderr)
    bar.set_postfix(progress_fields(record, no_signal.streak >= NO_SIGNAL_STEPS), refresh=False)
    bar.update(1)  # shows this step's postfix


def finish_run(run: Run, global_step: int, last_eval: dict[str, Any] | None) -> dict[str, Any]:
    """Save the final model, evaluate it (unless the last step did) and write summary.json."""
    out_dir, test = run.out_dir, run.test
    if distributed.is_writer():
        final_dir = rundir.replace_dir(
            out_dir, "final", lambda dir: save_model(run.model, run.tokenizer, dir)
        )
        run.callbacks.fire("on_save", global_step, final_dir)
        run.callbacks.fire("on_train_end", global_step)
    final = last_eval or (evaluate(run, test) if test else None)
    base_file = out_dir / "base_test.json"  # absent in run directories of older fastes versions
    base_correct = json.loads(base_file.read_text()) if base_file.is_file() else None
    gain, gain_se = math.nan, math.nan
    if base_correct and final:
        gain, gain_se = paired_gain(base_correct, final["correct"])
    base = run.metrics[0] if test else {}  # without held-out rows (a dataset without eval_dataset): none
    final = final or {}
    summary = {
        "base_test_accuracy": base.get("test_accuracy"),
        "final_test_accuracy": final.get("accuracy"),
        "test_gain": gain,
        "test_gain_se": gain_se,
        "test_problems": len(test),
        # What the gain is made of: answers in the verifiable format, and answers right when read leniently
        "base_test_format": base.get("test_format"),
        "final_test_format": final.get("format"),
        "base_test_lenient_accuracy": base.get("test_lenient_accuracy"),
        "final_test_lenient_accuracy": final.get("lenient_accuracy"),
        "steps": global_step,
        "out_dir": str(out_dir),
        "model_dir": str(out_dir / "final"),
    }
    if distributed.is_writer():
        write_atomic(out_dir / "summary.json", json.dumps(summary, indent=2))
    return summary
