"""Run by tests/test_distributed.py under `torchrun --nproc_per_node 2` (gloo, CPU): several `fastes train`
jobs through the real command line, in one launch so that the processes start only once.

argv: ROOT TASK. Writes each job's run directory under ROOT; errors a job is expected to raise go to
ROOT/<job>.rank<r>.stderr, exit codes to ROOT/<job>.rank<r>.exit.
"""

import contextlib
import datetime
import json
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from fastes import cli, distributed

root, task = Path(sys.argv[1]), sys.argv[2]
common = [
    "--batch_size",
    "8",
    "--max_new_tokens",
    "3",
    "--eval_size",
    "8",
    "--eval_every",
    "0",
    "--progress",
    "false",
]
# as ES in test_distributed.py
es = ["--es.iterations", "3", "--es.population", "4", "--es.sigma", "0.02", "--es.lr", "5e-5"]
grpo = ["--algorithm", "grpo", "--grpo.steps", "2", "--grpo.num_generations", "4"]
grpo += ["--grpo.num_iterations", "2"]

# One process group for all the jobs (train() uses it and leaves it open); a short timeout, so that a
# bug that leaves one rank waiting fails the test instead of hanging it.
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()


def job(name: str, *flags: str) -> None:
    with (root / f"{name}.rank{rank}.stderr").open("w") as log, contextlib.redirect_stderr(log):
        try:
            data = flags if "--dataset" in flags else ["--task", task, *flags]
            code = cli.main(["train", "--out_dir", str(root / name), *common, *data])
        except Exception as error:  # the test reads what each rank raised
            print(f"{type(error).__name__}: {error}", file=log)
            code = 1
    (root / f"{name}.rank{rank}.exit").write_text(str(code))
    dist.barrier()


job("es_member", *es, "--es.eval_mode", "member", "--checkpoint_every", "1")
if rank == 0:  # forget the last iteration: resuming must redo it from the step-2 checkpoint
    shutil.rmtree(root / "es_member_resumed", ignore_errors=True)
    shutil.copytree(root / "es_member", root / "es_member_resumed")
    shutil.rmtree(root / "es_member_resumed" / "checkpoints" / "step-00000003")
    shutil.rmtree(root / "es_member_resumed" / "final")
dist.barrier()
job("es_member_resumed", *es, "--es.eval_mode", "member", "--checkpoint_every", "1", "--resume")
if rank == 0:  # damage the newest checkpoint: every rank must refuse it, none may hang
    shutil.copytree(root / "es_member", root / "es_member_damaged")
    damaged = root / "es_member_damaged" / "checkpoints" / "step-00000003" / "tensors.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-8] + bytes(8))
dist.barrier()
job("es_member_damaged", *es, "--es.eval_mode", "member", "--checkpoint_every", "1", "--resume")
job("es_materialised", *es)
distributed.GRADIENT_BUCKET_ELEMENTS = 5000  # many small all-reduces: the bucketing is tested too
job("grpo", *grpo, "--checkpoint_every", "0")
job("bad_world", *es, "--es.population", "3", "--es.antithetic", "false")
if rank == 0:  # the same prompts as rows of a dataset, scored by two weighted reward functions
    rows = [json.loads(line) for line in Path(task.removeprefix("jsonl:")).read_text().splitlines()]
    for split in ("train", "test"):
        chosen = [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows if r["split"] == split]
        (root / f"dataset_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chosen))
    (root / "rewards.py").write_text(
        "def exact(completions, answer, **kwargs):\n"
        "    return [float(c.rstrip(';') == a) for c, a in zip(completions, answer)]\n"
        "def length(completions, **kwargs):\n"
        "    return [len(c) / 3 for c in completions]\n"
    )
dist.barrier()
rewards = [f"{root / 'rewards.py'}:exact", f"{root / 'rewards.py'}:length"]
dataset = ["--dataset", str(root / "dataset_train.jsonl"), "--eval_dataset", str(root / "dataset_test.jsonl")]
job("dataset", *es, *dataset, "--reward", *rewards, "--reward_weights", "1,0.5")
dist.destroy_process_group()
