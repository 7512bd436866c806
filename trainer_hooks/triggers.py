"""When to save: one helper for the usual triggers (every N steps, every T seconds, epoch end, preemption).

    trigger = SaveTrigger(every_steps=500, every_seconds=1800, on_epoch_end=True)
    ...
    if trigger.should_save(step, epoch_end=last_batch_of_epoch):
        ckpt.save(step, state)

``should_save`` is true when any enabled trigger fires: ``step % every_steps == 0`` (multiples, so
the cadence survives a resume), the epoch ended, ``every_seconds`` passed since the last true answer,
or preemption. A true answer counts as a save (the time interval restarts; the same step never fires
twice for the step trigger), so call it once per step and save when it says so. The time trigger uses ``time.monotonic`` (wall-clock jumps neither fire nor delay it) and counts from
the construction of the trigger or the last true answer. ``on_preemption`` fires on every call once
:func:`trainer_hooks.should_stop` is true (rlsup relayed the preemption signal, or SIGTERM arrived),
so the trainer saves where it is before it exits.
"""

from __future__ import annotations

import time
from typing import Callable

from trainer_hooks.heartbeat import should_stop


class SaveTrigger:
    def __init__(self, every_steps: int | None = None, every_seconds: float | None = None,
                 on_epoch_end: bool = False, on_preemption: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if every_steps is not None and every_steps < 1:
            raise ValueError("every_steps must be >= 1 (or None)")
        if every_seconds is not None and every_seconds <= 0:
            raise ValueError("every_seconds must be > 0 (or None)")
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.on_epoch_end = on_epoch_end
        self.on_preemption = on_preemption
        self._clock = clock
        self._last_time = clock()
        self._last_step: int | None = None
        self.last_reason: str | None = None

    def should_save(self, step: int, epoch_end: bool = False) -> bool:
        """True when a save is due at ``step``; ``last_reason`` says which trigger fired."""
        reason = None
        if self.on_preemption and should_stop():
            reason = "preemption"
        elif self.every_steps is not None and step % self.every_steps == 0 and step != self._last_step:
            reason = "steps"
        elif self.on_epoch_end and epoch_end:
            reason = "epoch_end"
        elif self.every_seconds is not None and self._clock() - self._last_time >= self.every_seconds:
            reason = "time"
        if reason is None:
            return False
        self.last_reason = reason
        self._last_step = step
        self._last_time = self._clock()
        return True
