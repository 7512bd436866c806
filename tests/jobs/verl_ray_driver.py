"""verl's process structure under Ray, on CPU (issue 20): what ``python -m verl.trainer.main_ppo`` does
on the head node of a Ray cluster, with verl 0.9.1's checkpoint code and none of vLLM.

* The driver (this process, the one rlsup launches) connects to the running cluster
  (``ray.init(address=...)``, as main_ppo does when ``RAY_ADDRESS`` is set) and blocks in
  ``ray.get(runner.run.remote(config))``: ``TaskRunner`` is a Ray actor (``verl/trainer/main_ppo.py``).
* ``TaskRunner.run`` is verl's single controller (``RayPPOTrainer.fit``): it owns the dataloader, asks
  the worker actor for each update, prints each step through verl's ``LocalLogger`` (Ray forwards the
  actor's stdout to the driver as ``(TaskRunner pid=N) step:N - ...``), and saves in
  ``_save_checkpoint``'s order: the worker's ``FSDPCheckpointManager``, then ``data.pt``, then the tracker.
* ``ActorRolloutWorker`` (a Ray actor, gloo world of one) holds the FSDP model and its checkpoint manager.

It never imports ``trainer_hooks``. Test knobs: ``RLSUP_TEST_*`` variables (the kill hook) reach the
controller actor; ``--freeze-at N`` makes the worker of attempt 0
(``RLSUP_RESTART_COUNT`` unset or 0 in the driver's environment) never return from step N's update,
as a stuck collective inside a worker does: the controller and the driver wait in ``ray.get``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import ray

JOBS = str(Path(__file__).resolve().parent)
#: Set in the worker actor's environment: the kill hook counts only the controller's file events.
WORKER_MARK = "VERL_RAY_WORKER"


@ray.remote(num_cpus=0)
class ActorRolloutWorker:
    """verl's ``ActorRolloutRefWorker`` reduced to the actor update and its checkpoints."""

    def __init__(self) -> None:
        sys.path.insert(0, JOBS)
        os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
        import torch.distributed as dist
        import verl_driver as vd

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        self.vd = vd
        self.model, self.optimizer, self.scheduler, self.manager, _ = vd.build(0)

    def update_actor(self, batch, step: int, freeze: bool, step_seconds: float) -> dict:
        if freeze:
            self.vd.freeze_here(step)
        return self.vd.train_step(self.model, self.optimizer, self.scheduler, batch, step_seconds)

    def save_checkpoint(self, path: str, step: int) -> None:
        self.manager.save_checkpoint(path, None, step, max_ckpt_to_keep=None)

    def load_checkpoint(self, path: str) -> None:
        self.manager.load_checkpoint(path)


@ray.remote(num_cpus=0)
class TaskRunner:
    """verl's ``TaskRunner``: the single controller, itself an actor."""

    def run(self, cfg: dict) -> int:
        # The worker actor first: its process starts and imports torch and verl while this actor imports them,
        # not after (about 4 s of every attempt here).
        worker = ActorRolloutWorker.options(runtime_env={"env_vars": {WORKER_MARK: "1"}}).remote()
        sys.path.insert(0, JOBS)
        os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
        import verl_driver as vd
        from verl.utils.logger.aggregate_logger import LocalLogger

        loader = vd.make_loader(0)  # the controller's dataloader (the model lives in the worker)
        logger = LocalLogger(print_to_console=True)
        step, folder = vd.resume_point(cfg["default_local_dir"], cfg["resume_mode"])
        if folder is not None:
            ray.get(worker.load_checkpoint.remote(os.path.join(folder, "actor")))
            vd.load_data(folder, loader)
        batches = iter(loader)
        while step < cfg["total_steps"]:
            step += 1
            try:
                batch = next(batches)
            except StopIteration:
                batches = iter(loader)
                batch = next(batches)
            freeze = cfg["freeze_at"] == step
            metrics = ray.get(worker.update_actor.remote(batch, step, freeze, cfg["step_seconds"]))
            if step == cfg["total_steps"] or step % cfg["save_freq"] == 0:
                local = os.path.join(cfg["default_local_dir"], f"global_step_{step}")
                print(f"local_global_step_folder: {local}", flush=True)
                ray.get(worker.save_checkpoint.remote(os.path.join(local, "actor"), step))
                vd.controller_save(cfg["default_local_dir"], step, loader)
            logger.log(data=metrics, step=step)
        print(f"training done at step {step}", flush=True)
        return step


def test_hooks_env() -> dict | None:
    """The kill hook's variables (tests/kill_matrix.py), handed to the controller actor: Ray starts
    actors from the raylet's environment, not the driver's. The worker actor opts out of counting."""
    hooks = {k: v for k, v in os.environ.items() if k.startswith("RLSUP_TEST_")}
    if not hooks:
        return None
    return {"env_vars": {**hooks, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--default-local-dir", required=True, help="trainer.default_local_dir")
    p.add_argument("--total-steps", type=int, default=6, help="trainer.total_training_steps")
    p.add_argument("--save-freq", type=int, default=2, help="trainer.save_freq")
    p.add_argument("--resume-mode", default="auto", help="trainer.resume_mode")
    p.add_argument("--step-seconds", type=float, default=0.0)
    p.add_argument("--freeze-at", type=int, default=0, help="attempt 0's worker never finishes this step")
    args = p.parse_args()
    first_attempt = os.environ.get("RLSUP_RESTART_COUNT", "0") == "0"
    cfg = {"default_local_dir": os.path.abspath(args.default_local_dir), "total_steps": args.total_steps,
           "save_freq": args.save_freq, "resume_mode": args.resume_mode, "step_seconds": args.step_seconds,
           "freeze_at": args.freeze_at if first_attempt else 0}
    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=True)
    runner = TaskRunner.options(runtime_env=test_hooks_env()).remote()
    step = ray.get(runner.run.remote(cfg))
    print(f"driver: TaskRunner finished at step {step}", flush=True)


if __name__ == "__main__":
    main()
