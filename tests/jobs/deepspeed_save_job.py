"""A real DeepSpeed writer on CPU: a tiny model under ZeRO, ``engine.save_checkpoint(dir)`` after each step.

Used by tests/layouts/test_layouts_deepspeed.py as the writer of the mid-save kill matrix. One process (or
each torchrun rank) joins a gloo group; the tag is DeepSpeed's default ``global_step{N}``.

    python tests/jobs/deepspeed_save_job.py SAVE_DIR STEPS [ZERO_STAGE] [ROLE...]

With ROLE arguments (e.g. ``_actor _critic``) it saves one engine per role into ``SAVE_DIR/ROLE``
as OpenRLHF does. With ``RLSUP_TEST_DS_LOAD=1`` it only calls ``engine.load_checkpoint(SAVE_DIR)`` and
prints what DeepSpeed loaded. With ``RLSUP_TEST_DS_RANK_DIES=R`` rank R (R > 0) waits, before writing its optimizer
shard of the last save, until rank 0 has rewritten ``latest`` to that tag, then SIGKILLs itself: the
order DeepSpeed allows (rank 0 writes ``latest`` before the final barrier), made deterministic.
"""

from __future__ import annotations

import os
import sys


def _env_defaults() -> None:
    """Single-process defaults; torchrun sets these itself."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", os.environ.get("RLSUP_TEST_PORT", "29533"))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _engine(stage: int):
    """A 2-layer model under DeepSpeed with a plain torch optimizer (ZeRO on CPU)."""
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1000000,
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def _die_after_latest(engine, save_dir: str, tag: str) -> None:
    """Wrap this rank's checkpoint engine: its optimizer shard of ``tag`` is never written."""
    import signal
    import time

    save = engine.checkpoint_engine.save

    def save_or_die(state_dict, path):
        if path.endswith("optim_states.pt") and os.path.basename(os.path.dirname(path)) == tag:
            latest = os.path.join(save_dir, "latest")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if os.path.exists(latest) and open(latest).read().strip() == tag:
                    break
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        return save(state_dict, path)

    engine.checkpoint_engine.save = save_or_die


def main() -> int:
    _env_defaults()
    import deepspeed
    import torch

    save_dir, steps = sys.argv[1], int(sys.argv[2])
    stage = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    roles = sys.argv[4:] or [""]
    import deepspeed.comm.ccl  # loads deepspeed.comm.torch too

    # The CPU accelerator JIT-compiles a shared-memory/CCL allreduce op (minutes on a fresh machine, needs a
    # compiler); it only speeds up collectives and plays no part in checkpointing, so it is skipped.
    # (sys.modules: the attribute deepspeed.comm.torch is the torch package itself)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    sys.modules["deepspeed.comm.ccl"].build_ccl_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    engines = {role: _engine(stage) for role in roles}
    if os.environ.get("RLSUP_TEST_DS_LOAD"):  # resume through DeepSpeed's own mechanism: tag=None reads `latest`
        for role, engine in engines.items():
            path, _ = engine.load_checkpoint(os.path.join(save_dir, role) if role else save_dir)
            print(f"loaded {path} global_steps={engine.global_steps} "
                  f"resume_step={os.environ.get('RLSUP_RESUME_STEP')}", flush=True)
        return 0
    dies = os.environ.get("RLSUP_TEST_DS_RANK_DIES")
    if dies and dies == os.environ["RANK"]:
        for role, engine in engines.items():
            _die_after_latest(engine, os.path.join(save_dir, role) if role else save_dir, f"global_step{steps}")
    for _ in range(steps):
        for engine in engines.values():
            x = torch.randn(2, 8)
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
        for role, engine in engines.items():
            engine.save_checkpoint(os.path.join(save_dir, role) if role else save_dir)
    print("saved", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
