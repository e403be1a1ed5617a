"""One script, three trainers: TRL's GRPOTrainer, fastes' GRPOTrainer and fastes' ESTrainer on the same
data and reward functions.

    python examples/side_by_side.py es     # fastes.ESTrainer
    python examples/side_by_side.py grpo   # fastes.GRPOTrainer: the same settings as TRL's, to the letter
    python examples/side_by_side.py trl    # trl.GRPOTrainer (pip install 'fastes[trl]')
    python examples/side_by_side.py es 2   # 2 steps instead of 10

TRL and fastes' GRPO differ only in the import. ES differs in its own setting, population_size; its
per_device_train_batch_size counts prompts (GRPO's counts completions, TRL's meaning).
"""

import sys

from datasets import Dataset

from fastes.models.loading import tiny_model_path
from fastes.tasks import task_dataset

rows, correct = task_dataset("countdown", limit=64)  # prompts + the countdown verifier as a reward function


def short(completions, **kwargs):  # TRL's signature: the dataset's columns arrive as keyword arguments
    return [1.0 if len(c) <= 12 else 0.0 for c in completions]


def main(which: str, output_dir: str, max_steps: int = 10) -> list[dict]:
    algorithm = {"num_generations": 4, "save_strategy": "no"}
    if which == "trl":
        from trl import GRPOConfig as Config
        from trl import GRPOTrainer as Trainer
    elif which == "grpo":
        from fastes import GRPOConfig as Config
        from fastes import GRPOTrainer as Trainer
    else:
        from fastes import ESConfig as Config
        from fastes import ESTrainer as Trainer

        algorithm = {"population_size": 8}
    args = Config(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=16,
        max_completion_length=12,
        reward_weights=[1.0, 0.1],
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        **algorithm,
    )
    trainer = Trainer(
        model=str(tiny_model_path()),
        reward_funcs=[correct, short],
        args=args,
        train_dataset=Dataset.from_list(rows),
    )
    trainer.train()
    return trainer.state.log_history


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "es"
    max_steps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    *steps, final = main(which, f"runs/side_by_side_{which}", max_steps)  # final: the end-of-training record
    for record in steps:
        print({k: v for k, v in record.items() if k.startswith("reward")})
    print(f"train_loss {final['train_loss']:.4f}, train_runtime {final['train_runtime']:.1f} s")
