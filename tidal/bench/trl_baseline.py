"""The embedded default's job run by TRL's ``GRPOTrainer``: the yardstick for ``tidal bench startup``.

Run: ``python -m tidal.bench.trl_baseline`` (needs the ``bench`` extra: ``pip install -e '.[bench]'``).

The same job as ``tidal train`` with no flags, in one process: the ``tiny`` preset built from the
same seed (``tidal.model.build_model``, random init), the character tokenizer, the ``digit-sum``
train split in the same order, the ``exact`` reward, 32 prompts x 8 samples per step, one-token
answers at temperature 1, GRPO with group std normalisation and PPO clipping 0.2, no KL term,
AdamW at lr 3e-3 (betas 0.9/0.99, 2 warm-up steps, then constant), gradient clipping 1.0, 60 steps,
fp32 without gradient checkpointing (TRL's defaults are bf16 and checkpointing; tidal's CPU run uses
neither).
Like tidal's default it logs and saves nothing but the last line; it prints the mean reward of the
last step and the seconds from its own start, so a whole-command timer sees the rest.
"""

from __future__ import annotations

import argparse
import time

T0 = time.perf_counter()


def build_args(steps: int, output_dir: str):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=256,  # 32 prompts x 8 samples, one optimizer step per generation
        num_generations=8,
        max_completion_length=1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=0.2,
        scale_rewards="group",
        loss_type="dapo",  # token-mean over the batch, as tidal's --loss-agg-mode token-mean
        learning_rate=3e-3,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=2,
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        seed=1234,
        use_cpu=True,
        bf16=False,  # fp32, as tidal on CPU (TRL's default is bf16)
        gradient_checkpointing=False,  # as tidal's default (TRL's default is on: a second forward per step)
        report_to="none",
        save_strategy="no",
        logging_steps=1,  # the last step's reward (tidal also prints one line per step)
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tidal.bench.trl_baseline", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--output-dir", default="/tmp/tidal-trl-baseline")
    args = p.parse_args(argv)

    from datasets import Dataset
    from trl import GRPOTrainer

    from tidal.data.tasks import task_rows
    from tidal.model.load import build_model, load_tokenizer, resolve_model

    spec = resolve_model("tiny")
    tokenizer = load_tokenizer(spec)
    model = build_model(spec, seed=1234)
    rows = task_rows("digit-sum", seed=1234).train
    data = Dataset.from_dict({"prompt": [r[0] for r in rows], "label": [r[1] for r in rows]})

    def exact(completions, label, **_):
        return [1.0 if c.strip() == y.strip() else 0.0 for c, y in zip(completions, label)]

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact,
        args=build_args(args.steps, args.output_dir),
        train_dataset=data,
        processing_class=tokenizer,
    )
    rewards: list[float] = []

    from transformers import TrainerCallback

    class LastReward(TrainerCallback):
        def on_log(self, _args, _state, _control, logs=None, **_):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    trainer.add_callback(LastReward())
    trainer.train()
    last = rewards[-1] if rewards else float("nan")
    print(f"done: {args.steps} steps, last reward_mean {last:.3f}, {time.perf_counter() - T0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
